//! A captured CUDA graph of the decode step (`GenerationConfig::cuda_graph`).
//!
//! On a GPU a decode step of a small batch is launch-bound: tens of kernels a layer, each
//! issued from the host. With the static cache every step has the same shapes and reads and
//! writes the same buffers, so the step is recorded once as a CUDA graph and replayed: the
//! inputs (token ids, positions, the cache slot to write) are copied into fixed device buffers,
//! one replay runs the whole forward and LM head, and the logits land in a fixed output buffer.
//!
//! The graph calls libtorch's `at::cuda::CUDAGraph` through `cuda_graph.cpp`, a shared library
//! of its own (`libtreetrain_cuda_graph.so`) loaded only when a graph is asked for, into a
//! process that already runs CUDA libtorch. It is found through `TREETRAIN_CUDA_GRAPH_LIB`,
//! beside the running executable (or its parent folder), or where the build put it.

use std::ffi::{c_char, c_int, c_void};

use tch::{Kind, Tensor};

use super::config::{GenerateError, GenerationConfig};
use crate::device::Device;
use crate::model::{CausalLm, KvCache, StaticCache};
use crate::util::ErrBuf;
use crate::util::runtime_library::{LibrarySpec, RuntimeLibrary};

/// The environment variable naming the graph library explicitly.
pub const LIBRARY_ENV: &str = "TREETRAIN_CUDA_GRAPH_LIB";
/// The library's file name.
pub(crate) const LIBRARY_NAME: &str = "libtreetrain_cuda_graph.so";

type NewFn = unsafe extern "C" fn(c_int, *mut *mut c_void, *mut c_char, usize) -> c_int;
type StepFn = unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void);

/// The library where the build put it and how it is found.
const SPEC: LibrarySpec = LibrarySpec {
    env: LIBRARY_ENV,
    name: LIBRARY_NAME,
    built: env!("TREETRAIN_CUDA_GRAPH_LIB_BUILT"),
    needs: "CUDA graphs need a CUDA libtorch in the process",
};

/// The loaded library's entry points.
struct Library {
    new: NewFn,
    begin: StepFn,
    end: StepFn,
    replay: StepFn,
    free: FreeFn,
    // Last: its functions are dropped before it closes.
    _lib: RuntimeLibrary,
}

impl Library {
    fn load() -> Result<Self, GenerateError> {
        let lib = SPEC.open().map_err(GenerateError::CudaGraph)?;
        let symbol = |name| lib.symbol(name).map_err(GenerateError::CudaGraph);
        // SAFETY: each symbol is the extern "C" function of cuda_graph.cpp with this signature.
        unsafe {
            Ok(Library {
                new: std::mem::transmute::<*mut c_void, NewFn>(symbol(c"tt_cuda_graph_new")?),
                begin: std::mem::transmute::<*mut c_void, StepFn>(symbol(c"tt_cuda_graph_begin")?),
                end: std::mem::transmute::<*mut c_void, StepFn>(symbol(c"tt_cuda_graph_end")?),
                replay: std::mem::transmute::<*mut c_void, StepFn>(symbol(c"tt_cuda_graph_replay")?),
                free: std::mem::transmute::<*mut c_void, FreeFn>(symbol(c"tt_cuda_graph_free")?),
                _lib: lib,
            })
        }
    }
}

/// One CUDA graph (`at::cuda::CUDAGraph`): record, then replay.
pub struct CudaGraph {
    graph: *mut c_void,
    lib: Library,
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: the pointer came from tt_cuda_graph_new of this library and is freed once.
        unsafe { (self.lib.free)(self.graph) };
    }
}

impl CudaGraph {
    /// An empty graph on CUDA device `index`.
    pub fn new(index: usize) -> Result<Self, GenerateError> {
        let lib = Library::load()?;
        let mut graph = std::ptr::null_mut();
        let mut err = ErrBuf::new();
        // SAFETY: writes one pointer into `graph`, or an error message into `err`.
        let status = unsafe { (lib.new)(index as c_int, &mut graph, err.ptr(), ErrBuf::LEN) };
        match status {
            0 => Ok(CudaGraph { graph, lib }),
            _ => Err(GenerateError::CudaGraph(err.message())),
        }
    }

    fn call(&self, f: StepFn, what: &str) -> Result<(), GenerateError> {
        let mut err = ErrBuf::new();
        // SAFETY: `graph` is this library's live graph; errors come back as text.
        match unsafe { f(self.graph, err.ptr(), ErrBuf::LEN) } {
            0 => Ok(()),
            _ => Err(GenerateError::CudaGraph(format!("{what}: {}", err.message()))),
        }
    }

    /// Records what `body` queues on this thread (nothing runs until a replay).
    pub fn capture<T>(&self, body: impl FnOnce() -> Result<T, GenerateError>) -> Result<T, GenerateError> {
        self.call(self.lib.begin, "capture begin")?;
        let out = body();
        let ended = self.call(self.lib.end, "capture end");
        let out = out?;
        ended?;
        Ok(out)
    }

    /// Runs the recorded work on the current stream.
    pub fn replay(&self) -> Result<(), GenerateError> {
        self.call(self.lib.replay, "replay")
    }
}

/// The decode step of one batch as a graph: its fixed input buffers and its logits.
pub(super) struct DecodeGraph {
    graph: CudaGraph,
    /// `[batch, 1]` int64: the tokens to forward.
    ids: Tensor,
    /// `[batch, 1]` int64: their positions.
    positions: Tensor,
    /// `[1]` int64: the cache slot the step writes (the static cache's `len`).
    slot: Tensor,
    /// `[batch, vocab]` f32: the step's logits (rewritten by every replay).
    logits: Tensor,
}

impl DecodeGraph {
    /// Records one decode step of `model` over `cache` (switched to writing at the device slot)
    /// with the validity `mask` `[batch, 1, 1, slots]`. Nothing is computed until a replay; the
    /// cache's length is left as it was.
    pub(super) fn capture(model: &CausalLm, cache: &mut StaticCache, mask: &Tensor) -> Result<Self, GenerateError> {
        let device = model.device();
        let Device::Cuda(index) = device else {
            return Err(GenerateError::Config(format!(
                "cuda_graph needs a CUDA device; the model is on {device}"
            )));
        };
        let b = cache.batch();
        let ids = device.zeros(&[b, 1], Kind::Int64)?;
        let positions = device.zeros(&[b, 1], Kind::Int64)?;
        let slot = cache.write_at_device_slot()?;
        let graph = CudaGraph::new(index)?;
        let before = cache.len();
        let logits = graph.capture(|| {
            let h = model.forward_cached(&ids, &positions, &mut *cache, mask)?;
            Ok(model.decode_logits(&h.select(1, 0)).f_to_kind(Kind::Float)?)
        });
        cache.rollback(before)?;
        Ok(DecodeGraph {
            graph,
            ids,
            positions,
            slot,
            logits: logits?,
        })
    }

    /// One decode step: `ids` and `positions` (host values, one per row) forwarded through the
    /// graph into `cache` at its current length; returns the logits (the graph's buffer).
    pub(super) fn step(
        &mut self,
        cache: &mut StaticCache,
        ids: &[i64],
        positions: &[i64],
    ) -> Result<Tensor, GenerateError> {
        if cache.len() >= cache.max_len {
            return Err(GenerateError::Config(format!(
                "the cache holds {} positions: all used",
                cache.max_len
            )));
        }
        let rows = self.ids.size()[0];
        self.ids.f_copy_(&Tensor::from_slice(ids).f_view([rows, 1])?)?;
        self.positions
            .f_copy_(&Tensor::from_slice(positions).f_view([rows, 1])?)?;
        let _ = self.slot.f_fill_(cache.len())?;
        self.graph.replay()?;
        cache.advance(1);
        Ok(self.logits.shallow_clone())
    }
}

/// Where a decode call stands with its CUDA graph (`GenerationConfig::cuda_graph`).
pub(super) enum GraphState {
    /// No graph asked for: every step runs eagerly.
    Off,
    /// Asked for; this step runs eagerly (it warms up libtorch's CUDA state: cuBLAS handles,
    /// kernels loaded), the next is recorded.
    WarmingUp,
    /// The next step is recorded, then replayed.
    Due,
    /// Recorded: every step is a replay.
    Ready(DecodeGraph),
}

impl GraphState {
    pub(super) fn new(cfg: &GenerationConfig, model: &CausalLm) -> Result<Self, GenerateError> {
        match (cfg.cuda_graph, model.device()) {
            (false, _) => Ok(GraphState::Off),
            (true, Device::Cuda(_)) => Ok(GraphState::WarmingUp),
            (true, other) => Err(GenerateError::Config(format!(
                "cuda_graph needs a CUDA device; the model is on {other}"
            ))),
        }
    }

    /// The logits of a step run through the graph (recorded first when due), or `None` when
    /// this step runs eagerly.
    pub(super) fn step<C: KvCache>(
        &mut self,
        model: &CausalLm,
        cache: &mut C,
        mask: &Tensor,
        ids: &[i64],
        positions: &[i64],
    ) -> Result<Option<Tensor>, GenerateError> {
        if matches!(self, GraphState::Off) {
            return Ok(None);
        }
        let cache = cache
            .as_static()
            .ok_or_else(|| GenerateError::Config("cuda_graph needs the static cache".into()))?;
        match self {
            GraphState::Off => Ok(None),
            GraphState::WarmingUp => {
                *self = GraphState::Due;
                Ok(None)
            }
            GraphState::Due => {
                let mut graph = DecodeGraph::capture(model, cache, mask)?;
                let logits = graph.step(cache, ids, positions)?;
                *self = GraphState::Ready(graph);
                Ok(Some(logits))
            }
            GraphState::Ready(graph) => Ok(Some(graph.step(cache, ids, positions)?)),
        }
    }
}
