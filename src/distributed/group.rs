//! Safe handles over the C++ shim (`c10d_shim.cpp`): a c10d store and a process group (Gloo's,
//! or NCCL's made by `libtreetrain_nccl.so`).
//! Every call returns the C++ exception's first line as a [`DistError`] naming this rank.

use std::ffi::{CString, c_char, c_int, c_void};
use std::time::Duration;

use tch::Tensor;

use super::error::DistError;
use crate::util::ErrBuf;

#[allow(non_camel_case_types)]
type tt_store = c_void;
#[allow(non_camel_case_types)]
type tt_group = c_void;
#[allow(non_camel_case_types)]
type tt_work = c_void;
/// tch's tensor handle is libtorch's `at::Tensor*`.
type AtTensor = *mut c_void;

unsafe extern "C" {
    fn tt_store_tcp(
        host: *const c_char,
        port: c_int,
        listen_fd: c_int,
        workers: c_int,
        timeout_s: f64,
        err: *mut c_char,
        len: usize,
    ) -> *mut tt_store;
    fn tt_store_file(
        path: *const c_char,
        workers: c_int,
        timeout_s: f64,
        err: *mut c_char,
        len: usize,
    ) -> *mut tt_store;
    fn tt_store_free(s: *mut tt_store);
    fn tt_store_add(
        s: *mut tt_store,
        key: *const c_char,
        delta: i64,
        out: *mut i64,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn tt_group_gloo(
        s: *mut tt_store,
        prefix: *const c_char,
        rank: c_int,
        size: c_int,
        hostname: *const c_char,
        interface: *const c_char,
        timeout_s: f64,
        err: *mut c_char,
        len: usize,
    ) -> *mut tt_group;
    fn tt_group_free(g: *mut tt_group);
    fn tt_store_raw(s: *mut tt_store) -> *mut c_void;
    fn tt_group_adopt(
        backend: *mut c_void,
        rank: c_int,
        size: c_int,
        cuda_device: c_int,
        timeout_s: f64,
    ) -> *mut tt_group;
    fn tt_all_reduce(
        g: *mut tt_group,
        ts: *const AtTensor,
        n: usize,
        average: c_int,
        staged: *mut c_int,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn tt_broadcast(
        g: *mut tt_group,
        ts: *const AtTensor,
        n: usize,
        root: c_int,
        staged: *mut c_int,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn tt_all_gather(g: *mut tt_group, input: AtTensor, out: AtTensor, err: *mut c_char, len: usize) -> c_int;
    fn tt_reduce_scatter(
        g: *mut tt_group,
        input: AtTensor,
        output: AtTensor,
        staged: *mut c_int,
        pending: *mut *mut tt_work,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn tt_all_gather_flat(
        g: *mut tt_group,
        input: AtTensor,
        output: AtTensor,
        staged: *mut c_int,
        pending: *mut *mut tt_work,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn tt_all_reduce_grads_start(
        g: *mut tt_group,
        params: *const AtTensor,
        n: usize,
        staged: *mut c_int,
        pending: *mut *mut tt_work,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn tt_work_wait(w: *mut tt_work, err: *mut c_char, len: usize) -> c_int;
    fn tt_work_free(w: *mut tt_work);
    fn tt_barrier(g: *mut tt_group, err: *mut c_char, len: usize) -> c_int;
    fn tt_built_with_gloo() -> c_int;
}

/// Whether this build can create Gloo process groups (its headers were found at build time).
pub(crate) fn built_with_gloo() -> bool {
    // SAFETY: a constant query.
    unsafe { tt_built_with_gloo() != 0 }
}

fn c_string(s: &str, rank: usize, op: &'static str) -> Result<CString, DistError> {
    CString::new(s).map_err(|_| DistError::new(rank, op, format!("{s:?} holds a NUL byte")))
}

/// A c10d key-value store (where ranks meet): TCP or file.
pub struct Store {
    ptr: *mut tt_store,
}

// SAFETY: c10d stores are used from any thread (their operations lock internally).
unsafe impl Send for Store {}

impl Store {
    /// A TCPStore: hosting it on the socket `listener` (bound by the caller, so the address is
    /// exactly the one asked for), or a client of `host:port`.
    pub(crate) fn tcp(
        host: &str,
        port: u16,
        listener: Option<std::net::TcpListener>,
        workers: usize,
        timeout: Duration,
        rank: usize,
    ) -> Result<Self, DistError> {
        let host_c = c_string(host, rank, "store")?;
        // The store takes the socket over: hand the fd out of Rust's ownership.
        let fd = listener.map_or(-1, std::os::fd::IntoRawFd::into_raw_fd);
        let mut err = ErrBuf::new();
        // SAFETY: valid C strings and buffer; the returned pointer is owned by `Store`.
        let ptr = unsafe {
            tt_store_tcp(
                host_c.as_ptr(),
                c_int::from(port),
                fd,
                workers as c_int,
                timeout.as_secs_f64(),
                err.ptr(),
                ErrBuf::LEN,
            )
        };
        Self::made(ptr, err, rank, format!("TCP store at {host}:{port}"))
    }

    /// A FileStore at `path` for `workers` processes.
    pub fn file(path: &std::path::Path, workers: usize, timeout: Duration, rank: usize) -> Result<Self, DistError> {
        let path_c = c_string(&path.to_string_lossy(), rank, "store")?;
        let mut err = ErrBuf::new();
        // SAFETY: as in `tcp`.
        let ptr = unsafe {
            tt_store_file(
                path_c.as_ptr(),
                workers as c_int,
                timeout.as_secs_f64(),
                err.ptr(),
                ErrBuf::LEN,
            )
        };
        Self::made(ptr, err, rank, format!("file store {}", path.display()))
    }

    /// Adds `delta` to the counter `key`; returns its new value (every rank sees every add).
    pub fn add(&self, key: &str, delta: i64, rank: usize) -> Result<i64, DistError> {
        let key_c = c_string(key, rank, "store")?;
        let (mut out, mut err) = (0i64, ErrBuf::new());
        // SAFETY: a live store, valid C string and out pointer.
        let rc = unsafe { tt_store_add(self.ptr, key_c.as_ptr(), delta, &mut out, err.ptr(), ErrBuf::LEN) };
        match rc {
            0 => Ok(out),
            _ => Err(DistError::new(rank, "store", err.message())),
        }
    }

    fn made(ptr: *mut tt_store, err: ErrBuf, rank: usize, what: String) -> Result<Self, DistError> {
        if ptr.is_null() {
            return Err(DistError::new(rank, "store", format!("{what}: {}", err.message())));
        }
        Ok(Store { ptr })
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: made by the shim, freed once.
        unsafe { tt_store_free(self.ptr) }
    }
}

/// Where Gloo's transport binds on this host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum GlooDevice {
    /// The address this host's hostname resolves to (Gloo's default device).
    #[default]
    Default,
    /// An address of this host (`127.0.0.1` keeps everything on loopback).
    Hostname(String),
    /// A network interface (`GLOO_SOCKET_IFNAME`).
    Interface(String),
}

/// A process group of `size` ranks meeting in a store: Gloo's (host memory) or NCCL's (one
/// GPU a rank).
pub struct ProcessGroup {
    ptr: *mut tt_group,
    rank: usize,
    size: usize,
    // The group holds the store through a prefix store; kept so it outlives the group (and
    // for the survivors of a failed collective to say who answered).
    store: Store,
    // The library that made an NCCL group; closed after the group is freed.
    _nccl: Option<super::nccl::NcclLibrary>,
}

// SAFETY: c10d process groups are thread-safe (their backends queue work under their own
// locks); treetrain calls one from one thread at a time, so the collectives' order is kept.
unsafe impl Send for ProcessGroup {}
// SAFETY: as for `Send`: a `full_shard` model and its trainer share the world, and call it from
// the training thread only.
unsafe impl Sync for ProcessGroup {}

/// The flat collectives of sharding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flat {
    /// Sum over ranks, each keeping its part.
    ReduceScatter,
    /// Every rank's part, in rank order.
    AllGather,
}

impl Flat {
    /// The collective's name in errors.
    pub fn name(self) -> &'static str {
        match self {
            Flat::ReduceScatter => "reduce_scatter",
            Flat::AllGather => "all_gather",
        }
    }
}

/// A flat collective in flight ([`ProcessGroup::start`]): its output is written once
/// [`Pending::wait`] returns. Dropped unwaited, it is waited for (errors ignored) and freed.
#[derive(Debug)]
pub struct Pending {
    ptr: *mut tt_work,
    rank: usize,
    op: &'static str,
}

// SAFETY: the work is c10d's, which any thread may wait for; one owner at a time.
unsafe impl Send for Pending {}

impl Pending {
    /// Waits for the collective (within the group's timeout); an error names the rank.
    pub fn wait(mut self) -> Result<(), DistError> {
        let ptr = std::mem::replace(&mut self.ptr, std::ptr::null_mut());
        if ptr.is_null() {
            return Ok(());
        }
        let mut err = ErrBuf::new();
        // SAFETY: a work the shim handed over and nobody freed (taken out of `self`).
        let rc = unsafe { tt_work_wait(ptr, err.ptr(), ErrBuf::LEN) };
        match rc {
            0 => Ok(()),
            _ => Err(DistError::new(self.rank, self.op, err.message())),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: as in `wait`; freed once.
            unsafe { tt_work_free(self.ptr) }
        }
    }
}

/// A summed or averaged reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// Element-wise sum over ranks.
    Sum,
    /// Element-wise mean over ranks.
    Mean,
}

/// The result of a collective on tensors: whether they went through host memory (tensors on a
/// device Gloo cannot read).
pub(crate) type ThroughHost = bool;

impl ProcessGroup {
    /// Joins (or, on rank 0 with a hosting store, opens) the group of `size` ranks in `store`,
    /// under key prefix `prefix`; `timeout` bounds the rendezvous and every collective.
    pub fn gloo(
        store: Store,
        prefix: &str,
        rank: usize,
        size: usize,
        device: &GlooDevice,
        timeout: Duration,
    ) -> Result<Self, DistError> {
        let prefix_c = c_string(prefix, rank, "process group")?;
        let (host, iface) = match device {
            GlooDevice::Default => (String::new(), String::new()),
            GlooDevice::Hostname(h) => (h.clone(), String::new()),
            GlooDevice::Interface(i) => (String::new(), i.clone()),
        };
        let (host_c, iface_c) = (
            c_string(&host, rank, "process group")?,
            c_string(&iface, rank, "process group")?,
        );
        let mut err = ErrBuf::new();
        // SAFETY: valid store pointer and C strings; the group is owned by `ProcessGroup`.
        let ptr = unsafe {
            tt_group_gloo(
                store.ptr,
                prefix_c.as_ptr(),
                rank as c_int,
                size as c_int,
                host_c.as_ptr(),
                iface_c.as_ptr(),
                timeout.as_secs_f64(),
                err.ptr(),
                ErrBuf::LEN,
            )
        };
        if ptr.is_null() {
            let message = format!("joining {size} processes: {} (did every rank start?)", err.message());
            return Err(DistError::new(rank, "process group", message));
        }
        Ok(ProcessGroup {
            ptr,
            rank,
            size,
            store,
            _nccl: None,
        })
    }

    /// An NCCL group of `size` ranks in `store` under `prefix`, this rank on CUDA device
    /// `device` (`libtreetrain_nccl.so` loaded, its NCCL versions checked). Tensors on the host
    /// are reduced through the device.
    pub fn nccl(
        store: Store,
        prefix: &str,
        (rank, size): (usize, usize),
        device: usize,
        timeout: Duration,
    ) -> Result<Self, DistError> {
        let fail = |m: String| DistError::new(rank, "NCCL process group", m);
        let library = super::nccl::NcclLibrary::load().map_err(fail)?;
        library.checked_versions().map_err(fail)?;
        // SAFETY: a live store; the shim lends its c10d::Store, which the group references.
        let raw = unsafe { tt_store_raw(store.ptr) };
        let backend = library
            .group(raw, prefix, (rank, size), device, timeout)
            .map_err(fail)?;
        // SAFETY: `backend` is an owning c10d::Backend* the shim takes over.
        let ptr = unsafe {
            tt_group_adopt(
                backend,
                rank as c_int,
                size as c_int,
                device as c_int,
                timeout.as_secs_f64(),
            )
        };
        Ok(ProcessGroup {
            ptr,
            rank,
            size,
            store,
            _nccl: Some(library),
        })
    }

    /// The store the group met in.
    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    fn check(&self, op: &'static str, rc: c_int, err: &ErrBuf) -> Result<(), DistError> {
        match rc {
            0 => Ok(()),
            _ => Err(DistError::new(self.rank, op, err.message())),
        }
    }

    /// Reduces each tensor over every rank, in place.
    pub fn all_reduce(&self, tensors: &[&Tensor], op: Reduce) -> Result<ThroughHost, DistError> {
        let ptrs: Vec<AtTensor> = tensors.iter().map(|t| t.as_ptr() as AtTensor).collect();
        let (mut staged, mut err) = (0, ErrBuf::new());
        // SAFETY: live tensors for the duration of the call.
        let rc = unsafe {
            tt_all_reduce(
                self.ptr,
                ptrs.as_ptr(),
                ptrs.len(),
                c_int::from(op == Reduce::Mean),
                &mut staged,
                err.ptr(),
                ErrBuf::LEN,
            )
        };
        self.check("all_reduce", rc, &err).map(|()| staged != 0)
    }

    /// Starts summing the gradients of `params` (one dtype; the same parameters in the same
    /// order on every rank) as one flat bucket; a parameter without a gradient takes part with
    /// zeros and gets one. The gradients hold the sum once the [`Pending`] is waited for, and
    /// must not change until then.
    pub(crate) fn start_grads(&self, params: &[&Tensor]) -> Result<(ThroughHost, Pending), DistError> {
        let ptrs: Vec<AtTensor> = params.iter().map(|t| t.as_ptr() as AtTensor).collect();
        let mut pending = Pending {
            ptr: std::ptr::null_mut(),
            rank: self.rank,
            op: "all_reduce (gradients)",
        };
        let (mut staged, mut err) = (0, ErrBuf::new());
        // SAFETY: live tensors for the duration of the call; the started collective holds its
        // own references to its flat copy and the gradients until it is waited for.
        let rc = unsafe {
            tt_all_reduce_grads_start(
                self.ptr,
                ptrs.as_ptr(),
                ptrs.len(),
                &mut staged,
                &mut pending.ptr,
                err.ptr(),
                ErrBuf::LEN,
            )
        };
        self.check("all_reduce (gradients)", rc, &err)
            .map(|()| (staged != 0, pending))
    }

    /// Copies each tensor of rank `root` into the same tensor on every other rank.
    pub fn broadcast(&self, tensors: &[&Tensor], root: usize) -> Result<ThroughHost, DistError> {
        let ptrs: Vec<AtTensor> = tensors.iter().map(|t| t.as_ptr() as AtTensor).collect();
        let (mut staged, mut err) = (0, ErrBuf::new());
        // SAFETY: as in `all_reduce`.
        let rc = unsafe {
            tt_broadcast(
                self.ptr,
                ptrs.as_ptr(),
                ptrs.len(),
                root as c_int,
                &mut staged,
                err.ptr(),
                ErrBuf::LEN,
            )
        };
        self.check("broadcast", rc, &err).map(|()| staged != 0)
    }

    /// Every rank's `input` (host tensors of one shape and dtype), stacked `[size, ...]`.
    pub fn all_gather(&self, input: &Tensor) -> Result<Tensor, DistError> {
        let mut shape = vec![self.size as i64];
        shape.extend(input.size());
        let out = Tensor::zeros(&shape, (input.kind(), tch::Device::Cpu));
        let mut err = ErrBuf::new();
        // SAFETY: as in `all_reduce`; `out` has the stacked shape.
        let rc = unsafe {
            tt_all_gather(
                self.ptr,
                input.as_ptr() as AtTensor,
                out.as_ptr() as AtTensor,
                err.ptr(),
                ErrBuf::LEN,
            )
        };
        self.check("all_gather", rc, &err).map(|()| out)
    }

    /// `op` from the flat `input` into the flat `output` (one dtype, contiguous), started and
    /// left running: `output` is written once the [`Pending`] is waited for (the tensors are
    /// kept alive until then). A reduce-scatter sums `input` `[size * n]` over every rank and
    /// leaves this rank's part (elements `rank * n ..`) in `output` `[n]`; an all-gather puts
    /// every rank's `input` `[n]` into `output` `[size * n]`, in rank order.
    pub fn start(&self, op: Flat, input: &Tensor, output: &Tensor) -> Result<(ThroughHost, Pending), DistError> {
        let n = output.numel().max(input.numel());
        let small = input.numel().min(output.numel());
        if small * self.size != n {
            return Err(DistError::new(
                self.rank,
                op.name(),
                format!(
                    "{} and {} elements for {} ranks",
                    input.numel(),
                    output.numel(),
                    self.size
                ),
            ));
        }
        let f = match op {
            Flat::ReduceScatter => tt_reduce_scatter,
            Flat::AllGather => tt_all_gather_flat,
        };
        let mut pending = Pending {
            ptr: std::ptr::null_mut(),
            rank: self.rank,
            op: op.name(),
        };
        let (mut staged, mut err) = (0, ErrBuf::new());
        // SAFETY: live tensors of the sizes checked above for the duration of the call; a
        // started collective holds its own references to them until it is waited for.
        let rc = unsafe {
            f(
                self.ptr,
                input.as_ptr() as AtTensor,
                output.as_ptr() as AtTensor,
                &mut staged,
                &mut pending.ptr,
                err.ptr(),
                ErrBuf::LEN,
            )
        };
        self.check(op.name(), rc, &err).map(|()| (staged != 0, pending))
    }

    /// Waits until every rank gets here.
    pub fn barrier(&self) -> Result<(), DistError> {
        let mut err = ErrBuf::new();
        // SAFETY: a live group.
        let rc = unsafe { tt_barrier(self.ptr, err.ptr(), ErrBuf::LEN) };
        self.check("barrier", rc, &err)
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: made by the shim, freed once, before its store and its library (fields drop
        // after this).
        unsafe { tt_group_free(self.ptr) }
    }
}
