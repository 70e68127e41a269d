//! What it costs the engine thread to have a step's grammar masks computed elsewhere while it
//! runs the forward pass: a scoped thread spawned per step (which then spreads the rows over
//! rayon's pool) against one task handed to rayon's pool with the answer sent back on a channel
//! (`MaskJob`). Each step's rows take WORK_US of spinning each (0: the hand-off alone); the
//! engine thread meanwhile "runs the forward" for FORWARD_US (spinning, as the CPU backend's
//! forward keeps a core busy; a CUDA step's engine thread only enqueues and then waits, which
//! FORWARD_US 0 models), then waits for the rows. Prints the median step time of each way and
//! what it costs above the ideal (the longer of the forward and the rows spread over the pool).
//!
//! `cargo run --release -p quire-engine --example mask_handoff -- [ROWS] [WORK_US] [FORWARD_US]`
//! (defaults 16 rows, 0 µs, 0 µs).

use std::hint::black_box;
use std::sync::mpsc::sync_channel;
use std::time::{Duration, Instant};

use rayon::prelude::*;

fn spin(us: u64) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_micros(us) {
        std::hint::spin_loop();
    }
}

fn rows_work(rows: Vec<u64>, work_us: u64) -> Vec<u64> {
    rows.into_par_iter()
        .map(|r| {
            spin(work_us);
            black_box(r)
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: ROWS WORK_US FORWARD_US"))
        .collect();
    let rows = args.first().copied().unwrap_or(16);
    let work_us = args.get(1).copied().unwrap_or(0);
    let forward_us = args.get(2).copied().unwrap_or(0);
    let steps = 2000;
    let mut scoped = Vec::with_capacity(steps);
    let mut pooled = Vec::with_capacity(steps);
    for i in 0..2 * steps {
        let data: Vec<u64> = (0..rows).collect();
        let t = Instant::now();
        if i % 2 == 0 {
            let out = std::thread::scope(|s| {
                let h = s.spawn(|| rows_work(data, work_us));
                spin(forward_us);
                h.join().unwrap()
            });
            black_box(out);
            scoped.push(t.elapsed().as_secs_f64() * 1e6);
        } else {
            let (tx, rx) = sync_channel(1);
            rayon::spawn(move || {
                let _ = tx.send(rows_work(data, work_us));
            });
            spin(forward_us);
            black_box(rx.recv().unwrap());
            pooled.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let threads = rayon::current_num_threads() as u64;
    let ideal = forward_us.max(work_us * rows.div_ceil(threads)) as f64;
    println!(
        "{rows} rows of {work_us} µs, forward {forward_us} µs, {threads} rayon threads, median of {steps} steps each (alternating):"
    );
    for (name, v) in [
        ("scoped thread per step", scoped),
        ("rayon task + channel", pooled),
    ] {
        let m = median(v);
        println!(
            "  {name}: {m:.1} µs per step, {:.1} µs above the ideal {ideal:.0} µs",
            m - ideal
        );
    }
}
