//! Seeded corruption of the real model: 1,000 truncations, byte flips,
//! random u64 writes and huge counts/lengths in the header region. Parsing
//! must return `Ok` or `Err` (with a one-line message) and never panic; a
//! panic is caught and reported with its seed. The file is loaded once and
//! every modification is undone after its case.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use quire_gguf::GgufFile;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CASES: u64 = 1000;

/// Where the header's count and length fields are, found by an independent
/// walk of the (known good) file.
struct Layout {
    /// Offsets 8 and 16.
    counts: [usize; 2],
    /// u64 length fields of keys, string values, arrays, array strings and tensor names.
    lengths: Vec<usize>,
    /// End of the tensor-info table (unpadded).
    infos_end: usize,
}

fn walk(b: &[u8]) -> Layout {
    let u32_at = |p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
    let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap()) as usize;
    fn value(b: &[u8], p: &mut usize, ty: u32, lengths: &mut Vec<usize>) {
        let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap()) as usize;
        match ty {
            0 | 1 | 7 => *p += 1,
            2 | 3 => *p += 2,
            4..=6 => *p += 4,
            10..=12 => *p += 8,
            8 => {
                lengths.push(*p);
                *p += 8 + u64_at(*p);
            }
            9 => {
                let elem = u32::from_le_bytes(b[*p..*p + 4].try_into().unwrap());
                lengths.push(*p + 4);
                let n = u64_at(*p + 4);
                *p += 12;
                for _ in 0..n {
                    value(b, p, elem, lengths);
                }
            }
            _ => panic!("walker: unknown type {ty} at {p}"),
        }
    }
    let (n_tensors, n_kv) = (u64_at(8), u64_at(16));
    let mut lengths = Vec::new();
    let mut p = 24;
    for _ in 0..n_kv {
        lengths.push(p);
        p += 8 + u64_at(p);
        let ty = u32_at(p);
        p += 4;
        value(b, &mut p, ty, &mut lengths);
    }
    for _ in 0..n_tensors {
        lengths.push(p);
        p += 8 + u64_at(p);
        let n_dims = u32_at(p) as usize;
        p += 4 + 8 * n_dims + 4 + 8;
    }
    Layout {
        counts: [8, 16],
        lengths,
        infos_end: p,
    }
}

/// Writes into `bytes`, remembering what to restore.
struct Patcher<'a> {
    bytes: &'a mut Vec<u8>,
    undo: Vec<(usize, Vec<u8>)>,
}

impl Patcher<'_> {
    fn write(&mut self, pos: usize, data: &[u8]) {
        let old = self.bytes[pos..pos + data.len()].to_vec();
        self.undo.push((pos, old));
        self.bytes[pos..pos + data.len()].copy_from_slice(data);
    }
    /// Undoes the writes, newest first (they may overlap).
    fn restore(&mut self) {
        while let Some((pos, old)) = self.undo.pop() {
            self.bytes[pos..pos + old.len()].copy_from_slice(&old);
        }
    }
}

/// A count or length no file of this size can satisfy, or a near miss.
fn huge(rng: &mut StdRng, file_len: u64) -> (u64, bool) {
    let v = match rng.random_range(0..6) {
        0 => u64::MAX,
        1 => u64::MAX / 2 + rng.random_range(0..1000),
        2 => 1 << rng.random_range(40..64),
        3 => file_len + rng.random_range(0..1000),
        4 => rng.random_range(file_len..u64::MAX),
        // Slightly wrong: may or may not be detected.
        _ => return (rng.random_range(0..4096), false),
    };
    (v, true)
}

#[test]
fn corrupted_model_never_panics() {
    let path = common::model_path();
    let mut bytes = std::fs::read(&path).unwrap();
    let original = GgufFile::parse(&bytes).expect("the unmodified model must parse");
    let layout = walk(&bytes);
    let data_offset = original.data_offset() as usize;
    assert_eq!(data_offset, layout.infos_end.next_multiple_of(32));
    assert!(
        layout.lengths.len() > 98_000,
        "walker found {}",
        layout.lengths.len()
    );
    let data_end = original
        .tensors()
        .iter()
        .map(|t| data_offset as u64 + t.offset + t.size_bytes())
        .max()
        .unwrap() as usize;
    let header_copy = bytes[..data_offset].to_vec();
    let file_len = bytes.len() as u64;

    let start = std::time::Instant::now();
    let mut failures = Vec::new();
    let (mut errors, mut must_err_ok) = (0u64, Vec::new());
    let mut by_kind = [0u64; 5];
    for seed in 0..CASES {
        let mut rng = StdRng::seed_from_u64(seed);
        let kind = (seed % 5) as usize;
        let mut len = bytes.len();
        let mut must_err = false;
        let mut p = Patcher {
            bytes: &mut bytes,
            undo: Vec::new(),
        };
        let what = match kind {
            0 => {
                len = if rng.random_bool(0.5) {
                    rng.random_range(0..data_offset + 64)
                } else {
                    rng.random_range(0..p.bytes.len())
                };
                must_err = len < data_end;
                format!("truncate to {len}")
            }
            1 => {
                let n = rng.random_range(1..=8);
                for _ in 0..n {
                    let pos = rng.random_range(0..data_offset);
                    let x = p.bytes[pos] ^ rng.random_range(1..=255u8);
                    p.write(pos, &[x]);
                }
                format!("flip {n} bytes")
            }
            2 => {
                let n = rng.random_range(1..=3);
                for _ in 0..n {
                    let pos = rng.random_range(0..data_offset - 8);
                    let v: u64 = rng.random();
                    p.write(pos, &v.to_le_bytes());
                }
                format!("{n} random u64 writes")
            }
            3 => {
                let pos = layout.counts[rng.random_range(0..2)];
                let (v, is_huge) = huge(&mut rng, file_len);
                must_err = is_huge;
                p.write(pos, &v.to_le_bytes());
                format!("count at {pos} = {v}")
            }
            _ => {
                let pos = layout.lengths[rng.random_range(0..layout.lengths.len())];
                let (v, is_huge) = huge(&mut rng, file_len);
                must_err = is_huge;
                p.write(pos, &v.to_le_bytes());
                format!("length at {pos} = {v}")
            }
        };
        let result = catch_unwind(AssertUnwindSafe(|| GgufFile::parse(&p.bytes[..len])));
        p.restore();
        match result {
            Err(_) => failures.push(format!("seed {seed} ({what}): parse panicked")),
            Ok(Err(e)) => {
                errors += 1;
                by_kind[kind] += 1;
                let msg = e.to_string();
                if msg.contains('\n') || msg.contains('\r') {
                    failures.push(format!("seed {seed} ({what}): multi-line error {msg:?}"));
                }
            }
            Ok(Ok(_)) if must_err => must_err_ok.push(format!("seed {seed} ({what})")),
            Ok(Ok(_)) => {}
        }
    }
    let elapsed = start.elapsed();
    eprintln!(
        "{CASES} corruptions in {elapsed:?}: {errors} errors \
         (by kind truncate/flip/u64/count/length: {by_kind:?} of {} each)",
        CASES / 5
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        must_err_ok.is_empty(),
        "accepted corruptions:\n{}",
        must_err_ok.join("\n")
    );
    // Most corruptions are caught (flips inside token text are legitimately not).
    assert!(
        errors * 10 >= CASES * 7,
        "only {errors} of {CASES} reported"
    );

    // Every byte was restored, and the file still parses to the same thing.
    assert_eq!(&bytes[..data_offset], &header_copy[..]);
    let again = GgufFile::parse(&bytes).unwrap();
    assert_eq!(again.metadata(), original.metadata());
    assert_eq!(again.tensors(), original.tensors());
}
