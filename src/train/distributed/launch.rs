//! `treetrain launch`: torchrun's job on one host without Python. The launcher hosts the
//! rendezvous store on loopback (as torchrun's agent does), starts one worker per rank with
//! torchrun's environment, and stops them all when one fails, naming it.

use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use super::{DistError, Store};

/// How to start the workers.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    /// Processes to start (ranks 0..n on this host).
    pub nproc: usize,
    /// The worker program and its arguments.
    pub program: std::path::PathBuf,
    /// Arguments of every worker.
    pub args: Vec<String>,
    /// Extra environment variables of every worker.
    pub env: Vec<(String, String)>,
    /// The store's port on 127.0.0.1 (0: any free port).
    pub port: u16,
    /// How long the store waits for workers and each worker waits for the others.
    pub timeout: Duration,
}

/// What a launch ended with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// The rendezvous store could not be hosted.
    #[error("launch: {0}")]
    Store(#[from] DistError),
    /// A worker could not be started.
    #[error("launch: rank {rank}: cannot start {program}: {message}")]
    Spawn {
        /// Its rank.
        rank: usize,
        /// The program.
        program: String,
        /// The OS's reason.
        message: String,
    },
    /// Workers failed; the rest were stopped. The ranks that were killed by a signal come
    /// first (the usual root cause: their peers then fail on the broken connection).
    #[error("launch: {}; stopped {stopped} other worker(s)", failures.join("; "))]
    Failed {
        /// `rank R (pid P) exited with status N` / `was killed by signal N`, one per failure.
        failures: Vec<String>,
        /// Workers still running that were stopped.
        stopped: usize,
    },
}

/// Starts `plan.nproc` workers and waits for all of them; the first failure stops the rest.
pub fn launch(plan: &LaunchPlan) -> Result<(), LaunchError> {
    let listener = TcpListener::bind(("127.0.0.1", plan.port))
        .map_err(|e| DistError::new(0, "store", format!("cannot listen on 127.0.0.1:{}: {e}", plan.port)))?;
    let port = listener
        .local_addr()
        .map_err(|e| DistError::new(0, "store", e.to_string()))?
        .port();
    // Kept alive until every worker is done: the workers are its clients.
    let _store = Store::tcp("127.0.0.1", port, Some(listener), plan.nproc, plan.timeout, 0)?;
    let mut workers = Vec::with_capacity(plan.nproc);
    for rank in 0..plan.nproc {
        match spawn(plan, rank, port) {
            Ok(child) => workers.push(Some(child)),
            Err(e) => {
                stop_all(&mut workers);
                return Err(e);
            }
        }
    }
    supervise(&mut workers)
}

fn spawn(plan: &LaunchPlan, rank: usize, port: u16) -> Result<Child, LaunchError> {
    let mut cmd = Command::new(&plan.program);
    // As torchrun: workers share the host's cores instead of each taking all of them
    // (oversubscribed libtorch thread pools slow every rank down). A set value is kept.
    if std::env::var_os("OMP_NUM_THREADS").is_none() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        cmd.env("OMP_NUM_THREADS", (cores / plan.nproc).max(1).to_string());
    }
    cmd.args(&plan.args)
        .envs(plan.env.iter().map(|(k, v)| (k, v)))
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("GROUP_RANK", "0")
        .env("WORLD_SIZE", plan.nproc.to_string())
        .env("LOCAL_WORLD_SIZE", plan.nproc.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TORCHELASTIC_USE_AGENT_STORE", "True")
        .env("TORCHELASTIC_RESTART_COUNT", "0")
        .spawn()
        .map_err(|e| LaunchError::Spawn {
            rank,
            program: plan.program.display().to_string(),
            message: e.to_string(),
        })
}

/// Polls the workers until all exit. On the first failure the others get a moment to fail
/// too (a dead peer breaks their collectives), then the rest are stopped.
fn supervise(workers: &mut [Option<Child>]) -> Result<(), LaunchError> {
    let mut failures: Vec<(bool, String)> = Vec::new();
    let mut first_failure: Option<Instant> = None;
    loop {
        let mut running = 0;
        for (rank, slot) in workers.iter_mut().enumerate() {
            let Some(child) = slot.as_mut() else { continue };
            let pid = child.id();
            match child.try_wait() {
                Ok(None) => running += 1,
                Ok(Some(status)) => {
                    *slot = None;
                    if !status.success() {
                        let signalled = std::os::unix::process::ExitStatusExt::signal(&status).is_some();
                        failures.push((signalled, format!("rank {rank} (pid {pid}) {}", describe(status))));
                    }
                }
                Err(e) => {
                    *slot = None;
                    failures.push((false, format!("rank {rank} (pid {pid}) could not be waited for ({e})")));
                }
            }
        }
        if !failures.is_empty() && first_failure.is_none() {
            first_failure = Some(Instant::now());
        }
        let grace_over = first_failure.is_some_and(|t| t.elapsed() > Duration::from_secs(2));
        if running == 0 || grace_over {
            let stopped = stop_all(workers);
            if failures.is_empty() {
                return Ok(());
            }
            // Signalled ranks first, each group in rank order (the sort is stable).
            failures.sort_by_key(|(signalled, _)| !signalled);
            return Err(LaunchError::Failed {
                failures: failures.into_iter().map(|(_, f)| f).collect(),
                stopped,
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stops every running worker (SIGTERM, then SIGKILL after a grace period); returns how many
/// were running.
fn stop_all(workers: &mut [Option<Child>]) -> usize {
    let mut running: Vec<&mut Child> = Vec::new();
    for c in workers.iter_mut().flatten() {
        if matches!(c.try_wait(), Ok(None)) {
            running.push(c);
        }
    }
    let n = running.len();
    for c in &running {
        // SAFETY: signalling a child we started and have not reaped.
        unsafe {
            libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for c in running {
        while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
    n
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".into(),
    }
}
