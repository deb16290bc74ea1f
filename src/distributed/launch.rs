//! `treetrain launch`: torchrun's job without Python. The launcher of node 0 hosts the
//! rendezvous store (as torchrun's agent does: on loopback for one node, on `MASTER_ADDR` for
//! several), each node's launcher starts one worker per local rank with torchrun's environment,
//! and stops its workers when one fails, naming it (a node's failure reaches the other nodes'
//! workers as a broken collective). SIGINT and SIGTERM sent to a launcher are passed to its
//! workers, which it then waits for.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use super::error::DistError;
use super::group::Store;

/// The hosts of a run, as torchrun's `--nnodes`, `--node-rank` and `--master-addr` give them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nodes {
    /// Hosts in the run, each with the same number of workers.
    pub count: usize,
    /// This host's index: its workers are ranks `rank * nproc ..` of the run.
    pub rank: usize,
    /// Node 0's address, where the store listens and every worker connects.
    pub master_addr: String,
}

impl Default for Nodes {
    /// One host: the store on loopback.
    fn default() -> Self {
        Nodes {
            count: 1,
            rank: 0,
            master_addr: "127.0.0.1".into(),
        }
    }
}

/// How to start the workers.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    /// Processes to start on this host (its local ranks 0..n).
    pub nproc: usize,
    /// The run's hosts.
    pub nodes: Nodes,
    /// The worker program and its arguments.
    pub program: std::path::PathBuf,
    /// Arguments of every worker.
    pub args: Vec<String>,
    /// Extra environment variables of every worker.
    pub env: Vec<(String, String)>,
    /// The store's port on `nodes.master_addr` (0: any free port, for one host only).
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
    /// The launcher got a terminating signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT): it passed the
    /// signal to its workers and waited for them.
    #[error("launch: stopped by signal {signal}; passed it to {workers} worker(s) and waited for them")]
    Signalled {
        /// The signal received.
        signal: i32,
        /// Workers that were running.
        workers: usize,
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
///
/// The terminating signals (SIGINT, SIGTERM, SIGHUP, SIGQUIT) are blocked in the calling thread for the call
/// (threads it starts inherit that) and polled for between checks on the workers, which get
/// the same signal: call it from a process whose other threads block them too, as the CLI's
/// single thread does. Workers start with no signal blocked and die with the launcher (a
/// parent-death signal), so a launcher killed outright leaves none training.
pub fn launch(plan: &LaunchPlan) -> Result<(), LaunchError> {
    let signals = BlockedSignals::block(&FORWARDED);
    let nodes = &plan.nodes;
    if nodes.count == 0 || nodes.rank >= nodes.count || nodes.count > 1 && plan.port == 0 {
        let why = format!(
            "node rank {} of {} node(s) at port {}: the node rank must lie below the node count, and several nodes need a --master-port",
            nodes.rank, nodes.count, plan.port
        );
        return Err(DistError::new(0, "launch", why).into());
    }
    let world = plan.nproc * nodes.count;
    // Node 0 hosts the store, kept alive until every worker of this host is done; the other
    // nodes' workers are its clients over the network.
    let (_store, port) = match nodes.rank {
        0 => {
            let addr = nodes.master_addr.as_str();
            let listener = TcpListener::bind((addr, plan.port))
                .map_err(|e| DistError::new(0, "store", format!("cannot listen on {addr}:{}: {e}", plan.port)))?;
            let port = listener
                .local_addr()
                .map_err(|e| DistError::new(0, "store", e.to_string()))?
                .port();
            (
                Some(Store::tcp(addr, port, Some(listener), world, plan.timeout, 0)?),
                port,
            )
        }
        _ => (None, plan.port),
    };
    let mut workers = Vec::with_capacity(plan.nproc);
    for local in 0..plan.nproc {
        match spawn(plan, local, port) {
            Ok(child) => workers.push(Some(child)),
            Err(e) => {
                stop_all(&mut workers, libc::SIGTERM);
                return Err(e);
            }
        }
    }
    supervise(&mut workers, nodes.rank * plan.nproc, &signals)
}

/// The signals a launcher passes on to its workers (and then stops): those a user, a terminal
/// or a job scheduler sends to end a job. SIGKILL cannot be caught; the workers' parent-death
/// signal covers it.
pub(crate) const FORWARDED: [i32; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// Signals taken as events: blocked while this lives (the previous mask restored after), and
/// waited for with `sigtimedwait`, so no handler and no global state are needed.
struct BlockedSignals {
    set: libc::sigset_t,
    previous: libc::sigset_t,
}

impl BlockedSignals {
    fn block(signals: &[i32]) -> Self {
        // SAFETY: both sets are plain values initialised by sigemptyset before use, and
        // pthread_sigmask only reads `set` and writes `previous`.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            let mut previous: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for &s in signals {
                libc::sigaddset(&mut set, s);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut previous);
            BlockedSignals { set, previous }
        }
    }

    /// One of the signals, if it arrives within `timeout`.
    fn wait(&self, timeout: Duration) -> Option<i32> {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
        };
        // SAFETY: `set` is an initialised signal set; a null info pointer is allowed.
        let got = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &ts) };
        (got > 0).then_some(got)
    }
}

impl Drop for BlockedSignals {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved by `block`.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.previous, std::ptr::null_mut());
        }
    }
}

/// Starts the worker of local rank `local` with torchrun's environment.
fn spawn(plan: &LaunchPlan, local: usize, port: u16) -> Result<Child, LaunchError> {
    let rank = plan.nodes.rank * plan.nproc + local;
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
        .env("LOCAL_RANK", local.to_string())
        .env("GROUP_RANK", plan.nodes.rank.to_string())
        .env("WORLD_SIZE", (plan.nproc * plan.nodes.count).to_string())
        .env("LOCAL_WORLD_SIZE", plan.nproc.to_string())
        .env("MASTER_ADDR", &plan.nodes.master_addr)
        .env("MASTER_PORT", port.to_string())
        .env("TORCHELASTIC_USE_AGENT_STORE", "True")
        .env("TORCHELASTIC_RESTART_COUNT", "0");
    let launcher = std::process::id();
    // SAFETY: runs in the child between fork and exec, calling only async-signal-safe
    // syscalls (sigprocmask, prctl, getppid) on values it owns.
    unsafe {
        cmd.pre_exec(move || {
            // The launcher's blocked signals would be inherited through exec: a worker would
            // ignore SIGTERM and SIGINT.
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            // Killed when the launcher dies, whatever kills it.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have died before the line above: then no signal will come.
            if libc::getppid() as u32 != launcher {
                return Err(std::io::Error::other("the launcher exited while this worker started"));
            }
            Ok(())
        });
    }
    cmd.spawn().map_err(|e| LaunchError::Spawn {
        rank,
        program: plan.program.display().to_string(),
        message: e.to_string(),
    })
}

/// Polls the workers until all exit. On the first failure the others get a moment to fail
/// too (a dead peer breaks their collectives), then the rest are stopped. A signal to the
/// launcher goes to every worker, which are then waited for. `first_rank`: the global rank of
/// local rank 0, for the messages.
fn supervise(workers: &mut [Option<Child>], first_rank: usize, signals: &BlockedSignals) -> Result<(), LaunchError> {
    let mut failures: Vec<(bool, String)> = Vec::new();
    let mut first_failure: Option<Instant> = None;
    loop {
        let mut running = 0;
        for (local, slot) in workers.iter_mut().enumerate() {
            let rank = first_rank + local;
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
            let stopped = stop_all(workers, libc::SIGTERM);
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
        if let Some(signal) = signals.wait(Duration::from_millis(50)) {
            let workers = stop_all(workers, signal);
            return Err(LaunchError::Signalled { signal, workers });
        }
    }
}

/// Stops every running worker (`signal`, then SIGKILL after a grace period); returns how many
/// were running.
fn stop_all(workers: &mut [Option<Child>], signal: i32) -> usize {
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
            libc::kill(c.id() as libc::pid_t, signal);
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
