//! Hand-built malformed files, one per validation rule: each must be
//! rejected with the specific error (and a one-line message), and the
//! near-miss valid variants must be accepted.

use quire_gguf::{GgmlType, GgufError, GgufFile, MAX_ARRAY_DEPTH};

/// Raw little-endian GGUF bytes, built field by field so that invalid files
/// (which `GgufWriter` refuses to produce) can be written.
struct Raw(Vec<u8>);

const U8: u32 = 0;
const U32: u32 = 4;
const BOOL: u32 = 7;
const STRING: u32 = 8;
const ARRAY: u32 = 9;
const U64: u32 = 10;

impl Raw {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u64(b.len() as u64);
        self.0.extend(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.bytes(s.as_bytes())
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(U32).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to 32 and appends `n` data bytes.
    fn data(&mut self, n: usize) -> &mut Self {
        let padded = self.0.len().next_multiple_of(32);
        self.0.resize(padded + n, 0xAB);
        self
    }
    fn parse(&self) -> Result<quire_gguf::GgufHeader, GgufError> {
        let r = GgufFile::parse(&self.0);
        if let Err(e) = &r {
            let msg = e.to_string();
            assert!(
                !msg.contains('\n') && !msg.contains('\r'),
                "multi-line: {msg:?}"
            );
        }
        r
    }
    fn err(&self) -> GgufError {
        self.parse().expect_err("malformed input was accepted")
    }
}

fn msg(r: &Raw) -> String {
    r.err().to_string()
}

#[test]
fn header_errors() {
    assert!(matches!(
        GgufFile::parse(&[]),
        Err(GgufError::Truncated { .. })
    ));
    assert!(matches!(
        GgufFile::parse(b"GGU"),
        Err(GgufError::Truncated { .. })
    ));
    assert!(matches!(
        GgufFile::parse(b"GGML\x03\0\0\0"),
        Err(GgufError::BadMagic { .. })
    ));
    for v in [0, 1, 4, u32::MAX] {
        assert!(matches!(
            Raw::new(v, 0, 0).err(),
            GgufError::UnsupportedVersion { .. }
        ));
    }
    assert!(msg(&Raw::new(3u32.swap_bytes(), 0, 0)).contains("big-endian"));
    assert!(matches!(Raw::new(3, 0, 0).parse(), Ok(h) if h.version() == 3));
    assert!(matches!(Raw::new(2, 0, 0).parse(), Ok(h) if h.version() == 2));
    // Header cut inside the counts.
    assert!(matches!(
        GgufFile::parse(&Raw::new(3, 0, 0).0[..20]),
        Err(GgufError::Truncated { offset: 16, .. })
    ));
}

#[test]
fn lying_counts_are_rejected_before_allocating() {
    for n in [1, 2, 1 << 20, u64::MAX / 13, u64::MAX] {
        let e = Raw::new(3, 0, n).err();
        assert!(matches!(e, GgufError::CountTooLarge { .. }), "kv {n}: {e}");
        let e = Raw::new(3, n, 0).err();
        assert!(
            matches!(e, GgufError::CountTooLarge { .. }),
            "tensors {n}: {e}"
        );
    }
    // An array of n u32 needs 4n bytes: 3 elements present, 4 claimed.
    let mut r = Raw::new(3, 0, 1);
    r.str("a").u32(ARRAY).u32(U32).u64(4).u32(1).u32(2).u32(3);
    assert!(matches!(r.err(), GgufError::CountTooLarge { count: 4, .. }));
    // An array of n strings needs at least 8n bytes: 2 empty strings, 3 claimed.
    let mut r = Raw::new(3, 0, 1);
    r.str("a").u32(ARRAY).u32(STRING).u64(3).str("").str("");
    assert!(msg(&r).contains("\"a\""));
    let mut r = Raw::new(3, 0, 1);
    r.str("a").u32(ARRAY).u32(STRING).u64(2).str("").str("");
    assert!(r.parse().is_ok());
    // String lengths past the end.
    for len in [100, u64::MAX] {
        let mut r = Raw::new(3, 0, 1);
        r.str("k").u32(STRING).u64(len).u8(b'x');
        assert!(matches!(r.err(), GgufError::Truncated { .. }));
        let mut r = Raw::new(3, 0, 1);
        r.u64(len).u32(U8).u8(0); // key length past the end
        assert!(matches!(r.err(), GgufError::Truncated { .. }));
    }
}

#[test]
fn metadata_errors() {
    let mut r = Raw::new(3, 0, 2);
    r.kv_u32("dup", 1).kv_u32("dup", 2);
    assert!(matches!(r.err(), GgufError::DuplicateKey { ref key, .. } if key == "dup"));

    let mut r = Raw::new(3, 0, 1);
    r.bytes(b"bad\xFFkey").u32(U8).u8(0);
    assert!(matches!(r.err(), GgufError::InvalidUtf8 { offset: 32, .. }));
    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(STRING).bytes(b"\xC3\x28");
    assert!(msg(&r).contains("\"k\""));

    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(13).u64(0);
    assert!(matches!(
        r.err(),
        GgufError::UnknownValueType { type_id: 13, .. }
    ));
    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(ARRAY).u32(99).u64(0);
    assert!(matches!(
        r.err(),
        GgufError::UnknownValueType { type_id: 99, .. }
    ));

    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(BOOL).u8(2);
    assert!(matches!(r.err(), GgufError::InvalidBool { byte: 2, .. }));

    // A key whose name contains a newline still gives a one-line message.
    let mut r = Raw::new(3, 0, 1);
    r.str("line1\nline2").u32(77);
    assert!(msg(&r).contains("line1\\nline2"));
}

fn nested(depth: usize) -> Raw {
    let mut r = Raw::new(3, 0, 1);
    r.str("n").u32(ARRAY);
    for _ in 1..depth {
        r.u32(ARRAY).u64(1);
    }
    r.u32(U8).u64(1).u8(42);
    r
}

#[test]
fn nested_arrays_are_bounded() {
    let h = nested(MAX_ARRAY_DEPTH).parse().unwrap();
    let mut v = h.get("n").unwrap();
    for _ in 0..MAX_ARRAY_DEPTH {
        v = &v.as_array().unwrap()[0];
    }
    assert_eq!(v.as_u64(), Some(42));
    let e = nested(MAX_ARRAY_DEPTH + 1).err();
    assert!(matches!(e, GgufError::NestingTooDeep { .. }), "{e}");
    // Far deeper than the limit: still an error, not a stack overflow.
    assert!(matches!(
        nested(100_000).err(),
        GgufError::NestingTooDeep { .. }
    ));
}

#[test]
fn alignment_rules() {
    for bad in [0u32, 3, 48] {
        let mut r = Raw::new(3, 0, 1);
        r.kv_u32("general.alignment", bad);
        assert!(matches!(r.err(), GgufError::BadAlignment { .. }), "{bad}");
    }
    let mut r = Raw::new(3, 0, 1);
    r.str("general.alignment").u32(U64).u64(32);
    assert!(msg(&r).contains("u32"));
    let mut r = Raw::new(3, 1, 1);
    r.kv_u32("general.alignment", 8).tensor("t", &[2], 0, 8);
    r.0.resize(r.0.len().next_multiple_of(8) + 16, 0);
    let h = r.parse().unwrap();
    assert_eq!((h.alignment(), h.data_offset() % 8), (8, 0));
}

#[test]
fn tensor_info_errors() {
    let one = |dims: &[u64], ty: u32, offset: u64, data: usize| {
        let mut r = Raw::new(3, 1, 0);
        r.tensor("w", dims, ty, offset).data(data);
        r
    };
    assert!(one(&[8], 0, 0, 32).parse().is_ok());
    let e = one(&[1, 1, 1, 1, 1], 0, 0, 32).err();
    assert!(matches!(e, GgufError::TooManyDims { n_dims: 5, .. }), "{e}");
    // Cut inside the dims.
    let e = Raw::new(3, 1, 0).str("a_long_name").u32(2).u64(8).err();
    assert!(matches!(e, GgufError::Truncated { .. }), "{e}");
    // A scalar (no dims) is one element.
    let h = one(&[], 0, 0, 4).parse().unwrap();
    assert_eq!(h.tensors()[0].size_bytes(), 4);

    for id in [4, 5, 16, 31, 1000] {
        let e = one(&[8], id, 0, 32).err();
        assert!(matches!(e, GgufError::UnknownTensorType { type_id, .. } if type_id == id));
        assert!(e.to_string().contains("\"w\""));
    }
    // Known but unsupported types parse.
    let h = one(&[256], GgmlType::Q3_K as u32, 0, 110).parse().unwrap();
    assert!(!h.tensors()[0].dtype.is_supported());

    for dims in [
        &[u64::MAX][..],
        &[1 << 32, 1 << 32],
        &[1 << 62, 2],
        &[2, 1 << 62, 2],
    ] {
        let e = one(dims, 0, 0, 32).err();
        assert!(matches!(e, GgufError::BadShape { .. }), "{dims:?}: {e}");
    }
    let e = one(&[16], GgmlType::Q8_0 as u32, 0, 64).err();
    assert!(e.to_string().contains("block size"), "{e}");

    let e = one(&[2], 0, 16, 64).err();
    assert!(
        matches!(e, GgufError::MisalignedTensor { offset: 16, .. }),
        "{e}"
    );
    let e = one(&[8], 0, 0, 31).err();
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e}");
    let e = one(&[8], 0, u64::MAX - 31, 32).err();
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e}");
    let e = one(&[1 << 40, 1 << 20], 0, 0, 32).err();
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e}");

    let mut r = Raw::new(3, 1, 0);
    r.bytes(b"\xFF").u32(1).u64(1).u32(0).u64(0).data(4);
    assert!(msg(&r).contains("tensor #0"));
}

#[test]
fn tensor_table_rules() {
    let mut r = Raw::new(3, 2, 0);
    r.tensor("a", &[8], 0, 0).tensor("a", &[8], 0, 32).data(64);
    assert!(matches!(r.err(), GgufError::DuplicateTensor { .. }));
    // Overlapping tensors are allowed, as long as both are inside the file.
    let mut r = Raw::new(3, 2, 0);
    r.tensor("a", &[16], 0, 0).tensor("b", &[8], 0, 32).data(64);
    let h = r.parse().unwrap();
    let f = GgufFile::from_bytes(r.0.clone()).unwrap();
    assert_eq!(f.tensor_data(&h.tensors()[1]).len(), 32);
    assert_eq!(f.tensor_data(f.tensor("a").unwrap()).len(), 64);
    // A TensorInfo from elsewhere is reported, not sliced out of bounds.
    let mut foreign = f.tensor("a").unwrap().clone();
    foreign.offset = 1 << 20;
    assert!(f.try_tensor_data(&foreign).is_err());
}
