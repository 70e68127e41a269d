//! Accepting and serving connections, with the limits a public server needs against clients that
//! hold sockets without sending anything useful: a cap on open connections (below the process's
//! file-descriptor limit, so the server never runs out of descriptors and stops answering), a time
//! limit on each request's headers that also closes keep-alive connections left idle, and
//! half-closed sockets served to the end (a client may shut down its sending side after the
//! request and still wait for the response). The body's own time limit is applied where the
//! handlers read it (`prep`). axum's `serve` offers none of these settings, so the accept loop
//! is here, on hyper's HTTP/1 connection builder.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// What a connection may use.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Time to receive a request's headers, counted from when the connection opens or from the
    /// end of the previous response: so also how long a keep-alive connection may sit idle.
    pub header_timeout: Duration,
    /// Most connections open at once; while at the cap, new ones wait in the listen backlog.
    pub max_connections: usize,
}

/// File descriptors left for everything but client sockets: the listener, the model file, the
/// runtime's own descriptors, the step log.
fn fd_reserve(soft_limit: usize) -> usize {
    (soft_limit / 4).max(16)
}

/// The open-file limit of this process (the soft one, which is what `accept` runs into).
#[cfg(unix)]
fn fd_limit() -> Option<usize> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a valid, exclusive pointer to a local.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    (rc == 0).then(|| usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX))
}

#[cfg(not(unix))]
fn fd_limit() -> Option<usize> {
    None
}

/// The connection cap actually used: `asked`, lowered to fit the file-descriptor limit.
pub fn effective_max_connections(asked: usize) -> usize {
    match fd_limit() {
        Some(l) => asked.min(l.saturating_sub(fd_reserve(l))).max(1),
        None => asked.max(1),
    }
}

/// Resolves once `rx` holds true (or its sender is gone).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Serves `app` on `listener` until `shutdown` turns true; then stops accepting, lets each
/// connection finish its request in flight, and returns once all are closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    mut shutdown: watch::Receiver<bool>,
) {
    let cap = limits.max_connections.max(1);
    let permits = Arc::new(Semaphore::new(cap));
    let mut last_error_log: Option<Instant> = None;
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = stopped(&mut shutdown) => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or a connection reset before it was accepted: log
                    // (at most once a second), wait a moment, go on.
                    if last_error_log.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
                        eprintln!("accept failed: {e}");
                        last_error_log = Some(Instant::now());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = stopped(&mut shutdown) => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut shutdown = shutdown.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .half_close(true);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = stopped(&mut shutdown) => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    drop(listener);
    // Every connection holds a permit until it closes.
    let _ = permits.acquire_many(cap as u32).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_descriptors_for_the_rest() {
        assert_eq!(fd_reserve(64), 16);
        assert_eq!(fd_reserve(1024), 256);
        let cap = effective_max_connections(usize::MAX);
        if let Some(l) = fd_limit() {
            assert!(cap < l, "cap {cap} vs limit {l}");
        }
        assert_eq!(effective_max_connections(0), 1);
    }
}
