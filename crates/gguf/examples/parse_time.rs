//! Times `GgufFile::parse` on a file (dev tool): `cargo run --example parse_time -- PATH`.
fn main() {
    let path = std::env::args().nth(1).expect("usage: parse_time PATH");
    let bytes = std::fs::read(path).unwrap();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let n = 20;
        for _ in 0..n {
            let h = quire_gguf::GgufFile::parse(&bytes).unwrap();
            std::hint::black_box(h);
        }
        println!("parse: {:?} per call", t.elapsed() / n);
    }
}
