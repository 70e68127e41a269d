//! The all-reduce and all-gather of CPU ranks in one process: every rank hands in its rows, the
//! last to arrive sums (or concatenates) them in rank order (so every run, and every rank, gets
//! the same bits) and wakes the others. A failed rank aborts the group, and every rank waiting in or arriving at an
//! all-reduce then gets an error instead of waiting forever.

use std::sync::{Condvar, Mutex, MutexGuard};

use crate::BackendError;

pub struct HostReduce {
    size: usize,
    state: Mutex<State>,
    ready: Condvar,
}

struct State {
    /// Each rank's rows of the all-reduce in progress.
    parts: Vec<Vec<f32>>,
    arrived: usize,
    /// The last completed collective's result (a sum, or the parts one after another), and its
    /// number.
    sum: Vec<f32>,
    round: u64,
    aborted: Option<String>,
}

impl HostReduce {
    pub fn new(size: usize) -> Self {
        Self {
            size,
            state: Mutex::new(State {
                parts: vec![Vec::new(); size],
                arrived: 0,
                sum: Vec::new(),
                round: 0,
                aborted: None,
            }),
            ready: Condvar::new(),
        }
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock left the state consistent (every write is
        // one assignment), so keep going; the panic itself aborts the group.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `x` ← the sum over the group's ranks of their `x` (all the same length), in rank order.
    pub fn all_reduce(&self, rank: usize, x: &mut [f32]) -> Result<(), BackendError> {
        let sum = |parts: &[Vec<f32>], out: &mut Vec<f32>| {
            if parts.iter().any(|p| p.len() != parts[0].len()) {
                return Err("ranks reduced rows of different lengths".to_string());
            }
            out.extend_from_slice(&parts[0]);
            for p in &parts[1..] {
                out.iter_mut().zip(p).for_each(|(s, v)| *s += v);
            }
            Ok(())
        };
        let st = self.collective(rank, x, sum)?;
        x.copy_from_slice(&st.sum);
        Ok(())
    }

    /// `out` ← every rank's `part` (lengths may differ), one after another in rank order.
    pub fn all_gather(
        &self,
        rank: usize,
        part: &[f32],
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let concat = |parts: &[Vec<f32>], out: &mut Vec<f32>| {
            parts.iter().for_each(|p| out.extend_from_slice(p));
            Ok(())
        };
        let st = self.collective(rank, part, concat)?;
        out.clear();
        out.extend_from_slice(&st.sum);
        Ok(())
    }

    /// One round: hands in `part`; the last rank to arrive runs `combine` on every rank's part
    /// (an error there aborts the group); every rank then reads the result in the returned
    /// state's `sum`.
    fn collective(
        &self,
        rank: usize,
        part: &[f32],
        combine: impl FnOnce(&[Vec<f32>], &mut Vec<f32>) -> Result<(), String>,
    ) -> Result<MutexGuard<'_, State>, BackendError> {
        let mut st = self.lock();
        if let Some(why) = &st.aborted {
            return Err(aborted(why));
        }
        st.parts[rank].clear();
        st.parts[rank].extend_from_slice(part);
        st.arrived += 1;
        let round = st.round;
        if st.arrived == self.size {
            let State { parts, sum, .. } = &mut *st;
            sum.clear();
            if let Err(why) = combine(parts, sum) {
                st.aborted = Some(why.clone());
                self.ready.notify_all();
                return Err(aborted(&why));
            }
            st.arrived = 0;
            st.round += 1;
            self.ready.notify_all();
        } else {
            while st.round == round && st.aborted.is_none() {
                st = self.ready.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            if st.round == round {
                return Err(aborted(st.aborted.as_deref().unwrap_or("")));
            }
        }
        Ok(st)
    }

    /// Stops the group: every rank waiting in an all-reduce, or arriving later, gets an error.
    pub fn abort(&self, why: &str) {
        let mut st = self.lock();
        st.aborted.get_or_insert_with(|| why.to_string());
        self.ready.notify_all();
    }
}

fn aborted(why: &str) -> BackendError {
    BackendError::Config(format!("the tensor-parallel group stopped: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn ranks_get_the_same_rank_ordered_sum_every_round() {
        let g = Arc::new(HostReduce::new(3));
        let outs: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let g = g.clone();
                    s.spawn(move || {
                        (0..50)
                            .map(|round| {
                                let mut x = vec![r as f32 * 0.1 + round as f32, 1e8, -1e8];
                                g.all_reduce(r, &mut x).unwrap();
                                x
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for round in 0..50 {
            let want0 = (0.0f32 + round as f32) + (0.1 + round as f32) + (0.2 + round as f32);
            for rank in &outs {
                assert_eq!(rank[round], outs[0][round]);
            }
            assert_eq!(outs[0][round][0], want0);
            assert_eq!(outs[0][round][1], 1e8 + 1e8 + 1e8);
        }
    }

    #[test]
    fn all_gather_concatenates_uneven_parts_in_rank_order() {
        let g = Arc::new(HostReduce::new(3));
        let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let g = g.clone();
                    s.spawn(move || {
                        let mut out = vec![f32::NAN; 2];
                        for round in 0..20 {
                            let part = vec![(10 * r + round) as f32; r + 1];
                            g.all_gather(r, &part, &mut out).unwrap();
                        }
                        out
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for out in outs {
            assert_eq!(out, [19.0, 29.0, 29.0, 39.0, 39.0, 39.0]);
        }
    }

    #[test]
    fn an_abort_wakes_a_waiting_rank_with_an_error() {
        let g = Arc::new(HostReduce::new(2));
        let waiter = {
            let g = g.clone();
            std::thread::spawn(move || g.all_reduce(0, &mut [1.0]))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        g.abort("rank 1 failed: out of memory");
        let e = waiter.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("rank 1 failed: out of memory"), "{e}");
        assert!(g.all_reduce(1, &mut [1.0]).is_err());
    }
}
