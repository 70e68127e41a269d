//! Parallel sections for the forward pass. A decode step of a small model is ~150 short parallel
//! sections (a few µs each); waking sleeping workers for each one costs as much as the work. The
//! `Team` keeps its workers spinning for a while after each section (then parks them), like
//! llama.cpp's OpenMP team, and runs a section as "every thread takes tasks from one counter".
//! `Parallel` lets the kernels run on either a `Team` or a rayon pool (tests, `attn-bench`).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Something that runs `f(task)` for every task in `0..tasks`, spread over its threads.
pub trait Parallel: Sync {
    fn threads(&self) -> usize;
    fn run_tasks(&self, tasks: usize, f: &(dyn Fn(usize) + Sync));
}

impl Parallel for rayon::ThreadPool {
    fn threads(&self) -> usize {
        self.current_num_threads().max(1)
    }
    fn run_tasks(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks <= 1 || self.current_num_threads() <= 1 {
            (0..tasks).for_each(f);
            return;
        }
        self.scope(|s| {
            for t in 0..tasks {
                s.spawn(move |_| f(t));
            }
        });
    }
}

/// A pointer into an output buffer that the tasks of one parallel section write in disjoint
/// parts. `at` (a method, so closures capture the whole wrapper, not its raw field).
pub struct DisjointPtr<T>(*mut T);

// SAFETY: users only write disjoint elements from different tasks, and the section ends before
// the buffer it points into is used again.
unsafe impl<T> Sync for DisjointPtr<T> {}
unsafe impl<T> Send for DisjointPtr<T> {}

impl<T> DisjointPtr<T> {
    pub fn new(buf: &mut [T]) -> Self {
        DisjointPtr(buf.as_mut_ptr())
    }
    pub fn at(&self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Incremented to publish a section; workers run each epoch once.
    epoch: AtomicU64,
    /// The section's closure (valid while `remaining > 0`).
    job: UnsafeCell<Option<Job>>,
    tasks: AtomicUsize,
    next_task: AtomicUsize,
    /// Workers still inside the current section.
    remaining: AtomicUsize,
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

// SAFETY: `job` is written only by the thread that owns the section, before publishing the epoch
// (SeqCst), and read by workers after they observe it; the owner waits for every worker to finish
// before the closure goes out of scope.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// A fixed team: the calling thread plus `n - 1` workers.
pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n: usize,
}

/// Busy spins before a worker starts yielding (a few µs: the gap between two sections).
const SPINS: u32 = 4_000;
/// How long an idle worker keeps yielding before it parks.
const YIELD_FOR: std::time::Duration = std::time::Duration::from_millis(2);

impl Team {
    pub fn new(n: usize) -> Team {
        let n = n.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            tasks: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            remaining: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let workers = (1..n)
            .map(|i| {
                let sh = shared.clone();
                std::thread::Builder::new()
                    .name(format!("quire-cpu-{i}"))
                    .spawn(move || worker(&sh))
                    .expect("spawn worker thread")
            })
            .collect();
        Team { shared, workers, n }
    }
}

fn take_tasks(sh: &Shared, job: &(dyn Fn(usize) + Sync)) {
    let tasks = sh.tasks.load(SeqCst);
    loop {
        let t = sh.next_task.fetch_add(1, SeqCst);
        if t >= tasks {
            break;
        }
        job(t);
    }
}

fn worker(sh: &Shared) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        let mut idle_since = None;
        loop {
            if sh.stop.load(SeqCst) {
                return;
            }
            if sh.epoch.load(SeqCst) != seen {
                break;
            }
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
                continue;
            }
            // Then yield (cheap when nothing else wants the core, and fair to other threads when
            // the machine is oversubscribed) for up to YIELD_FOR before parking.
            let since = *idle_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() < YIELD_FOR {
                std::thread::yield_now();
                continue;
            }
            idle_since = None;
            // Park until the next section.
            let g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.sleepers.fetch_add(1, SeqCst);
            let _g = sh
                .wake
                .wait_while(g, |_| {
                    sh.epoch.load(SeqCst) == seen && !sh.stop.load(SeqCst)
                })
                .unwrap_or_else(|e| e.into_inner());
            sh.sleepers.fetch_sub(1, SeqCst);
            spins = 0;
        }
        seen = sh.epoch.load(SeqCst);
        // SAFETY: published before the epoch; the owner keeps it alive until `remaining` is 0.
        let job = unsafe { (*sh.job.get()).expect("job published with the epoch") };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            take_tasks(sh, unsafe { &*job })
        }));
        if r.is_err() {
            sh.panicked.store(true, SeqCst);
        }
        sh.remaining.fetch_sub(1, SeqCst);
    }
}

impl Parallel for Team {
    fn threads(&self) -> usize {
        self.n
    }

    fn run_tasks(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks <= 1 || self.n == 1 {
            (0..tasks).for_each(f);
            return;
        }
        let sh = &*self.shared;
        // SAFETY: no worker reads `job` until the epoch below changes, and the previous section
        // ended (remaining == 0) before `run_tasks` returned.
        unsafe {
            let short: &(dyn Fn(usize) + Sync) = f;
            *sh.job.get() = Some(std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(short));
        }
        sh.tasks.store(tasks, SeqCst);
        sh.next_task.store(0, SeqCst);
        sh.remaining.store(self.n - 1, SeqCst);
        sh.epoch.fetch_add(1, SeqCst);
        if sh.sleepers.load(SeqCst) > 0 {
            let _g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        {
            // Waits for the workers even if `f` panics here, so none outlives the closure.
            let _wait = WaitAll(sh);
            take_tasks(sh, f);
        }
        if sh.panicked.swap(false, SeqCst) {
            panic!("a worker thread panicked in a parallel section");
        }
    }
}

struct WaitAll<'a>(&'a Shared);

impl Drop for WaitAll<'_> {
    fn drop(&mut self) {
        let mut spins = 0u32;
        while self.0.remaining.load(SeqCst) > 0 {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every worker is done with the closure.
        unsafe { *self.0.job.get() = None };
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once_across_many_sections() {
        let team = Team::new(3);
        for round in 0..2000usize {
            let tasks = round % 17;
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            team.run_tasks(tasks, &|t| {
                hits[t].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "round {round}");
        }
    }

    #[test]
    fn parked_workers_wake_up() {
        let team = Team::new(2);
        std::thread::sleep(std::time::Duration::from_millis(300)); // long enough to park
        let sum = AtomicUsize::new(0);
        team.run_tasks(100, &|t| {
            sum.fetch_add(t, SeqCst);
        });
        assert_eq!(sum.load(SeqCst), 4950);
    }
}
