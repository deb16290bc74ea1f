//! The processes of one training run (as torchrun describes them: `launch_env`) and the
//! collectives the trainer core needs from them.

use std::net::{TcpListener, ToSocketAddrs};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::backend::{BackendChoice, CommBackend};
use super::error::DistError;
use super::group::{Flat, GlooDevice, Pending, ProcessGroup, Reduce, Store};
use super::launch_env::LaunchEnv;
use crate::device::DeviceSpec;

/// Gradients are all-reduced in flat buckets of about this many bytes (DDP's default is 25 MB;
/// smaller buckets bound the extra memory of the flat copy).
pub(crate) const BUCKET_BYTES: usize = 4 << 20;

/// Bytes and seconds spent in collectives, and seconds waiting for the slowest rank.
#[derive(Debug, Default)]
pub(crate) struct CommStats {
    bytes: AtomicU64,
    micros: AtomicU64,
    wait_micros: AtomicU64,
}

/// A snapshot of the communicator's `CommStats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct CommTotals {
    /// Bytes all-reduced (per rank, as sent into the collective).
    pub bytes: u64,
    /// Seconds inside collectives.
    pub seconds: f64,
    /// Seconds waiting for the slowest rank before the gradient all-reduce (measured only with
    /// [`World::measure_waiting`]).
    pub wait_seconds: f64,
}

/// The processes of a run: this one's rank among `size`, and the process group joining them
/// (none for a single process, where every collective is the identity).
pub struct World {
    /// This process's rank.
    pub rank: usize,
    /// Processes in the run.
    pub size: usize,
    /// Rank on this host (which accelerator it drives).
    pub local_rank: usize,
    group: Option<ProcessGroup>,
    /// Where this group's keys live in its store.
    prefix: String,
    /// How long a collective waits for the peers (`distributed_timeout_s`), named when one
    /// times out.
    timeout: Duration,
    /// A collective failed and the peers were asked (once: the group is broken after).
    failed: AtomicBool,
    staged_said: AtomicBool,
    measure_wait: AtomicBool,
    stats: CommStats,
    held: std::sync::Mutex<Option<HeldState>>,
}

/// What one rank holds of a training run's state, in bytes (shown by the world's display).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldState {
    /// The `fsdp` setting (`no_shard`, `shard_grad_op`, `full_shard`).
    pub fsdp: &'static str,
    /// Trained parameters (`full_shard`: this rank's fp32 shard; a layer is whole only while
    /// it runs).
    pub parameters: u64,
    /// Their gradients: whole during backward, or (`full_shard`) this rank's fp32 shard, a
    /// layer's whole gradients only until its backward ends.
    pub gradients: u64,
    /// Optimizer state: AdamW's moments and master weights (this rank's shards when sharded).
    pub optimizer: u64,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "World {{ rank: {}, size: {}, local_rank: {} }}",
            self.rank, self.size, self.local_rank
        )
    }
}

impl Default for World {
    fn default() -> Self {
        World::single()
    }
}

impl World {
    /// One process.
    pub fn single() -> Self {
        Self::with_group((0, 1, 0), None, (String::new(), Duration::ZERO))
    }

    fn with_group(
        (rank, size, local_rank): (usize, usize, usize),
        group: Option<ProcessGroup>,
        (prefix, timeout): (String, Duration),
    ) -> Self {
        World {
            rank,
            size,
            local_rank,
            group,
            prefix,
            timeout,
            failed: AtomicBool::new(false),
            staged_said: AtomicBool::new(false),
            measure_wait: AtomicBool::new(false),
            stats: CommStats::default(),
            held: std::sync::Mutex::new(None),
        }
    }

    /// The world torchrun (or `treetrain launch`) described in the environment, joined over
    /// `backend` for a run on `device`; one process when none is. `timeout` bounds the
    /// rendezvous and every collective.
    pub fn from_env(timeout: Duration, backend: CommBackend, device: DeviceSpec) -> Result<Self, DistError> {
        match LaunchEnv::from_env()? {
            None => Ok(World::single()),
            Some(env) => World::join(&env, timeout, backend.choose(device, env.local_rank, env.rank)?),
        }
    }

    /// Joins the group `env` describes over the `chosen` backend: rank 0 hosts the TCP store on
    /// `MASTER_ADDR:MASTER_PORT` unless the launcher's agent already does.
    pub(crate) fn join(env: &LaunchEnv, timeout: Duration, chosen: BackendChoice) -> Result<Self, DistError> {
        let listener = match (env.rank, env.agent_store) {
            (0, false) => Some(bind(&env.master_addr, env.master_port)?),
            _ => None,
        };
        let store = Store::tcp(&env.master_addr, env.master_port, listener, env.size, timeout, env.rank)?;
        // A process may build several trainers (several groups) on one launcher's store: each
        // rank counts itself in once per group, so the count names the group, and the groups'
        // keys never meet.
        let attempt = format!("treetrain/attempt_{}", env.attempt);
        let joined = store.add(&format!("{attempt}/joined"), 1, env.rank)?;
        let prefix = format!("{attempt}/group_{}", (joined - 1) / env.size as i64);
        let group = match &chosen {
            BackendChoice::Nccl { device, .. } => {
                ProcessGroup::nccl(store, &prefix, (env.rank, env.size), *device, timeout)?
            }
            BackendChoice::Gloo(_) => {
                ProcessGroup::gloo(store, &prefix, env.rank, env.size, &env.gloo_device(), timeout)?
            }
        };
        if env.rank == 0 {
            match chosen {
                BackendChoice::Nccl { said, .. } => eprintln!("treetrain: collectives through {said}"),
                BackendChoice::Gloo(Some(why)) => eprintln!("treetrain: collectives through Gloo, not NCCL: {why}"),
                BackendChoice::Gloo(None) => {}
            }
        }
        Ok(Self::with_group(
            (env.rank, env.size, env.local_rank),
            Some(group),
            (prefix, timeout),
        ))
    }

    /// Joins a group of `size` ranks meeting in the file `path` (tests, shared file systems);
    /// Gloo on loopback.
    pub fn with_file_store(path: &Path, rank: usize, size: usize, timeout: Duration) -> Result<Self, DistError> {
        let store = Store::file(path, size, timeout, rank)?;
        let device = GlooDevice::Hostname("127.0.0.1".into());
        let group = ProcessGroup::gloo(store, "treetrain", rank, size, &device, timeout)?;
        Ok(Self::with_group(
            (rank, size, rank),
            Some(group),
            ("treetrain".into(), timeout),
        ))
    }

    /// Whether this is rank 0: the one that logs, displays and writes checkpoints.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// Whether more than one process takes part.
    pub fn is_distributed(&self) -> bool {
        self.group.is_some()
    }

    /// This rank's contiguous share of `n` items (shares differ by at most one item; the low
    /// ranks take the extra ones).
    pub fn share(&self, n: usize) -> Range<usize> {
        share(n, self.rank, self.size)
    }

    /// Before every gradient all-reduce, wait for all ranks first and time that wait apart
    /// (benches: it separates waiting for the slowest rank from moving bytes).
    pub fn measure_waiting(&self, on: bool) {
        self.measure_wait.store(on, Ordering::Relaxed);
    }

    /// Bytes and seconds in collectives so far.
    pub fn comm_totals(&self) -> CommTotals {
        CommTotals {
            bytes: self.stats.bytes.load(Ordering::Relaxed),
            seconds: self.stats.micros.load(Ordering::Relaxed) as f64 * 1e-6,
            wait_seconds: self.stats.wait_micros.load(Ordering::Relaxed) as f64 * 1e-6,
        }
    }

    fn timed<T>(
        &self,
        bytes: u64,
        f: impl FnOnce(&ProcessGroup) -> Result<T, DistError>,
    ) -> Option<Result<T, DistError>> {
        let g = self.group.as_ref()?;
        let start = Instant::now();
        let out = f(g).map_err(|e| self.asked_peers(g, e));
        self.stats
            .micros
            .fetch_add(start.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.stats.bytes.fetch_add(bytes, Ordering::Relaxed);
        Some(out)
    }

    fn note_staged(&self, staged: bool) {
        if staged && self.is_main() && !self.staged_said.swap(true, Ordering::Relaxed) {
            eprintln!(
                "treetrain: rank {}: tensors off the host are reduced through host memory (Gloo reads host memory only; NCCL reduces CUDA tensors in place: distributed_backend)",
                self.rank
            );
        }
    }

    /// Sums the gradients of `params` over every rank (the same parameters in the same order
    /// everywhere), in buckets of about [`BUCKET_BYTES`], each waited for before the next
    /// fills; afterwards every rank holds the global sum.
    pub(crate) fn all_reduce_grads(&self, params: &[&Tensor]) -> Result<(), DistError> {
        if self.measure_wait.load(Ordering::Relaxed)
            && let Some(g) = &self.group
        {
            let start = Instant::now();
            g.barrier()?;
            self.stats
                .wait_micros
                .fetch_add(start.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
        super::GradBuckets::new(0).add_all(params, self)
    }

    /// One bucket of [`World::all_reduce_grads`], started and left running: the gradients of
    /// `params` (one dtype) hold the sum once [`World::wait`] returns (`None`: one process,
    /// nothing to do); a parameter without a gradient takes part with zeros and gets one.
    /// Timed and counted as the all-reduce's bytes.
    pub(crate) fn start_grads(&self, params: &[&Tensor]) -> Result<Option<Pending>, DistError> {
        let bytes = params
            .iter()
            .map(|p| p.numel() as u64 * p.kind().elt_size_in_bytes() as u64)
            .sum();
        match self.timed(bytes, |g| g.start_grads(params)) {
            None => Ok(None),
            Some(r) => r.map(|(staged, pending)| {
                self.note_staged(staged);
                Some(pending)
            }),
        }
    }

    /// Sums the flat `input` `[size * n]` over every rank into this rank's part `output` `[n]`
    /// (elements `rank * n ..`); one process copies its input.
    pub fn reduce_scatter(&self, input: &Tensor, output: &Tensor) -> Result<(), DistError> {
        self.wait(self.start(Flat::ReduceScatter, input, output)?)
    }

    /// Every rank's flat `input` `[n]` into `output` `[size * n]`, in rank order; one process
    /// copies its input.
    pub(crate) fn all_gather_into(&self, input: &Tensor, output: &Tensor) -> Result<(), DistError> {
        self.wait(self.start(Flat::AllGather, input, output)?)
    }

    /// [`World::reduce_scatter`] or `World::all_gather_into` started and left running:
    /// `output` holds the result once [`World::wait`] returns (`None`: one process, done). Timed
    /// and counted by the larger side's bytes.
    pub fn start(&self, op: Flat, input: &Tensor, output: &Tensor) -> Result<Option<Pending>, DistError> {
        let larger = input.numel().max(output.numel());
        let bytes = (larger * input.kind().elt_size_in_bytes()) as u64;
        match self.timed(bytes, |g| tch::no_grad(|| g.start(op, input, output))) {
            None => tch::no_grad(|| output.shallow_clone().f_copy_(input))
                .map(|_| None)
                .map_err(|e| DistError::new(self.rank, op.name(), e.to_string())),
            Some(r) => r.map(|(staged, pending)| {
                self.note_staged(staged);
                Some(pending)
            }),
        }
    }

    /// Waits for a started collective; the time blocked counts as time in collectives (what
    /// compute did not hide).
    pub fn wait(&self, pending: Option<Pending>) -> Result<(), DistError> {
        let Some(p) = pending else { return Ok(()) };
        match self.timed(0, |_| p.wait()) {
            Some(r) => r,
            None => Ok(()),
        }
    }

    /// Sums `values` over every rank, in place (f64 on the wire: counts and losses stay exact).
    pub fn sum(&self, values: &mut [f64]) -> Result<(), DistError> {
        if self.group.is_none() || values.is_empty() {
            return Ok(());
        }
        let t = Tensor::from_slice(values);
        let bytes = (values.len() * 8) as u64;
        if let Some(r) = self.timed(bytes, |g| g.all_reduce(&[&t], Reduce::Sum)) {
            r?;
        }
        let summed = Vec::<f64>::try_from(&t).map_err(|e| DistError::new(self.rank, "all_reduce", e.to_string()))?;
        values.copy_from_slice(&summed);
        Ok(())
    }

    /// Copies rank 0's `tensors` into every rank's (the starting weights).
    pub(crate) fn broadcast_from_main(&self, tensors: &[&Tensor]) -> Result<(), DistError> {
        match self.timed(0, |g| tch::no_grad(|| g.broadcast(tensors, 0))) {
            None => Ok(()),
            Some(r) => r.map(|staged| self.note_staged(staged)),
        }
    }

    /// Every rank's `bytes`, in rank order (small payloads: scored rollouts, checksums).
    pub(crate) fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let Some(g) = &self.group else {
            return Ok(vec![bytes.to_vec()]);
        };
        let to_vec =
            |t: &Tensor| Vec::<i64>::try_from(t).map_err(|e| DistError::new(self.rank, "all_gather", e.to_string()));
        let gather = |t: &Tensor| g.all_gather(t).map_err(|e| self.asked_peers(g, e));
        let lengths = to_vec(&gather(&Tensor::from_slice(&[bytes.len() as i64]))?.view([-1]))?;
        let longest = lengths.iter().copied().max().unwrap_or(0).max(1) as usize;
        let mut padded = bytes.to_vec();
        padded.resize(longest, 0);
        let all = gather(&Tensor::from_slice(&padded))?;
        let all = Vec::<u8>::try_from(&all.view([-1]).to_kind(Kind::Uint8))
            .map_err(|e| DistError::new(self.rank, "all_gather", e.to_string()))?;
        Ok(lengths
            .iter()
            .enumerate()
            .map(|(r, &n)| all[r * longest..r * longest + n as usize].to_vec())
            .collect())
    }

    /// Records what this rank holds of the run's state (its display shows it).
    pub(crate) fn set_held(&self, held: HeldState) {
        *self.held.lock().unwrap_or_else(|e| e.into_inner()) = Some(held);
    }

    /// What this rank holds of the run's state, once a trainer said.
    pub fn held(&self) -> Option<HeldState> {
        *self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until every rank gets here.
    pub fn barrier(&self) -> Result<(), DistError> {
        match &self.group {
            None => Ok(()),
            Some(g) => g.barrier().map_err(|e| self.asked_peers(g, e)),
        }
    }

    /// `e`, a failed collective, with the peers that did not answer: the first failure of a
    /// rank reports itself in the store, then waits a moment for every peer to do the same (a
    /// peer that died or is stuck never does). A store that cannot be reached was rank 0's
    /// (its host, gone). Asked once: the group is broken after a failure.
    fn asked_peers(&self, g: &ProcessGroup, mut e: DistError) -> DistError {
        if self.failed.swap(true, Ordering::Relaxed) {
            return e;
        }
        if e.message.to_lowercase().contains("timeout") || e.message.to_lowercase().contains("timed out") {
            let s = self.timeout.as_secs_f64();
            e.message
                .push_str(&format!(" (no answer within distributed_timeout_s = {s} s)"));
        }
        let key = |rank: usize| format!("{}/failed/rank{rank}", self.prefix);
        let store = g.store();
        if store.add(&key(self.rank), 1, self.rank).is_err() {
            e.silent = if self.rank == 0 { Vec::new() } else { vec![0] };
            e.message.push_str(" (the rendezvous store is unreachable)");
            return e;
        }
        let started = Instant::now();
        let mut silent: Vec<usize> = (0..self.size).filter(|&r| r != self.rank).collect();
        while !silent.is_empty() && started.elapsed() < PEER_ANSWER {
            silent.retain(|&r| store.add(&key(r), 0, self.rank).map_or(true, |n| n == 0));
            if !silent.is_empty() {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        e.silent = silent;
        e
    }
}

/// How long the survivors of a failed collective wait for each other's answer.
const PEER_ANSWER: Duration = Duration::from_secs(3);

impl World {
    fn rows(&self) -> Vec<(&'static str, String)> {
        let c = self.comm_totals();
        let mut rows = match self.is_distributed() {
            false => vec![(
                "processes",
                "1 (this notebook or process; `treetrain launch --nproc-per-node N -- sft --config FILE` scales a saved config out)".into(),
            )],
            true => vec![
                ("processes", format!("{} (c10d ProcessGroupGloo)", self.size)),
                ("this rank", format!("{} (local rank {})", self.rank, self.local_rank)),
                (
                    "collectives so far",
                    format!("{:.1} MB in {:.2} s; waited {:.2} s for peers", c.bytes as f64 / 1e6, c.seconds, c.wait_seconds),
                ),
            ],
        };
        if let Some(h) = self.held() {
            let mb = |b: u64| b as f64 / 1e6;
            rows.push((
                "state per rank",
                format!(
                    "fsdp = {}: parameters {:.1} MB, gradients {:.1} MB (whole during backward), optimizer {:.1} MB",
                    h.fsdp,
                    mb(h.parameters),
                    mb(h.gradients),
                    mb(h.optimizer)
                ),
            ));
        }
        rows
    }
}

impl crate::display::Rich for World {
    fn html(&self) -> String {
        crate::display::rows_card("Processes", &self.rows())
    }
    fn text(&self) -> String {
        crate::display::rows_text(&self.rows())
    }
}

crate::display::rich_display!(World);

/// Rank `rank`'s contiguous share of `n` items among `size` ranks.
pub fn share(n: usize, rank: usize, size: usize) -> Range<usize> {
    let size = size.max(1);
    (n * rank / size)..(n * (rank + 1) / size)
}

/// A listening socket on exactly `addr:port` (the store takes it over), so a one-host run
/// listens on loopback only and a port in use is an error naming it.
pub fn bind(addr: &str, port: u16) -> Result<TcpListener, DistError> {
    let fail = |m: String| DistError::new(0, "store", format!("cannot listen on {addr}:{port}: {m}"));
    let addrs: Vec<_> = (addr, port)
        .to_socket_addrs()
        .map_err(|e| fail(e.to_string()))?
        .collect();
    TcpListener::bind(&addrs[..]).map_err(|e| fail(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_renders_itself() {
        use crate::display::Rich;
        let w = World::single();
        assert!(w.text().starts_with("processes: 1 (") && w.text().contains("treetrain launch"));
        assert!(w.html().contains("<h4>Processes</h4>") && !w.html().contains("Debug"));
        let w = World::single();
        w.set_held(HeldState {
            fsdp: "shard_grad_op",
            parameters: 4_000_000,
            gradients: 4_000_000,
            optimizer: 4_000_000,
        });
        let text = w.text();
        assert!(text.contains("fsdp = shard_grad_op: parameters 4.0 MB"), "{text}");
    }

    #[test]
    fn shares_cover_every_item_once() {
        for n in 0..12 {
            for size in 1..5 {
                let parts: Vec<usize> = (0..size).flat_map(|r| share(n, r, size)).collect();
                assert_eq!(parts, (0..n).collect::<Vec<_>>());
                let lens: Vec<usize> = (0..size).map(|r| share(n, r, size).len()).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
            }
        }
    }

    #[test]
    fn a_taken_port_is_an_error_naming_it() {
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = held.local_addr().unwrap().port();
        let e = bind("127.0.0.1", port).unwrap_err();
        assert!(e.message.contains(&format!("127.0.0.1:{port}")), "{e}");
    }

    /// Two ranks as threads of one process, meeting in a file store: every collective against
    /// the sums and copies computed by hand.
    #[test]
    fn collectives_on_two_ranks() {
        let dir = std::env::temp_dir().join(format!("treetrain-world-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("store");
        let _ = std::fs::remove_file(&path);
        let run = |rank: usize| {
            let path = path.clone();
            std::thread::spawn(move || {
                let w = World::with_file_store(&path, rank, 2, Duration::from_secs(30)).unwrap();
                let mut v = [rank as f64 + 1.0, 10.0];
                w.sum(&mut v).unwrap();
                let p = Tensor::from_slice(&[rank as f32, 1.0]).set_requires_grad(true);
                let q = Tensor::from_slice(&[5.0f32]).set_requires_grad(true);
                if rank == 0 {
                    (&p * 2.0).sum(Kind::Float).backward(); // q gets no gradient on rank 0
                } else {
                    ((&p * 3.0).sum(Kind::Float) + &q).backward();
                }
                w.all_reduce_grads(&[&p, &q]).unwrap();
                let w0 = Tensor::from_slice(&[rank as f32 * 7.0]);
                w.broadcast_from_main(&[&w0]).unwrap();
                let gathered = w.all_gather_bytes(&vec![rank as u8; rank + 1]).unwrap();
                // Rank r holds [10r, 10r + 1, 10r + 2, 10r + 3]: the sums are [10, 12, 14, 16].
                let flat = Tensor::arange(4, (Kind::Float, tch::Device::Cpu)) + 10.0 * rank as f64;
                let part = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu));
                w.reduce_scatter(&flat, &part).unwrap();
                let whole = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu));
                w.all_gather_into(&part, &whole).unwrap();
                w.barrier().unwrap();
                assert_eq!(
                    Vec::<f32>::try_from(&part).unwrap(),
                    [10.0 + 4.0 * rank as f32, 12.0 + 4.0 * rank as f32]
                );
                assert_eq!(Vec::<f32>::try_from(&whole).unwrap(), [10.0, 12.0, 14.0, 16.0]);
                (
                    v,
                    Vec::<f32>::try_from(p.grad()).unwrap(),
                    Vec::<f32>::try_from(q.grad()).unwrap(),
                    w0.double_value(&[0]),
                    gathered,
                )
            })
        };
        let (a, b) = (run(0), run(1));
        for out in [a.join().unwrap(), b.join().unwrap()] {
            assert_eq!(out.0, [3.0, 20.0]);
            assert_eq!(out.1, vec![5.0, 5.0]);
            assert_eq!(out.2, vec![1.0]);
            assert_eq!(out.3, 0.0);
            assert_eq!(out.4, vec![vec![0u8], vec![1u8, 1]]);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
