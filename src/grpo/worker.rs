//! Async rollouts: a generation thread with its own copy of the weights fills a bounded queue
//! of scored groups (one prompt's completions), each tagged with the weight version that
//! generated it.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tch::{Tensor, nn::VarStore};

use super::panic_message;
use super::producer::RolloutProducer;
use super::rollouts::QueuedGroup;
use crate::model::Model;
use crate::train::TrainError;
use crate::train::snapshot::{load_snapshot, snapshot};

struct Slots {
    groups: VecDeque<Result<QueuedGroup, String>>,
    weights: Option<(u64, Vec<(String, Tensor)>)>,
    stop: bool,
    finished: bool,
}

struct Shared {
    slots: Mutex<Slots>,
    changed: Condvar,
    capacity: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Slots> {
        // A poisoned lock only means the other side panicked; the data is still consistent.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Marks the queue finished when the thread ends, however it ends (even by panic), so the
/// trainer never waits on a dead generator.
struct FinishGuard(Arc<Shared>);

impl Drop for FinishGuard {
    fn drop(&mut self) {
        self.0.lock().finished = true;
        self.0.changed.notify_all();
    }
}

/// The generation thread and its queue. Dropping it stops and joins the thread.
pub struct AsyncRollouts {
    shared: Arc<Shared>,
    handle: Option<JoinHandle<()>>,
    published: u64,
    published_bytes: usize,
}

impl std::fmt::Debug for AsyncRollouts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncRollouts")
            .field("queued", &self.queued())
            .field("published", &self.published)
            .finish()
    }
}

impl AsyncRollouts {
    /// Starts generating at once with `model` (weights of `version`), at most `capacity`
    /// finished groups waiting (the thread generates a batch of `producer.per_batch` prompts
    /// at a time and queues its groups one by one).
    pub fn spawn(mut producer: RolloutProducer, model: Model, version: u64, capacity: usize) -> Self {
        let shared = Arc::new(Shared {
            slots: Mutex::new(Slots {
                groups: VecDeque::new(),
                weights: None,
                stop: false,
                finished: false,
            }),
            changed: Condvar::new(),
            capacity: capacity.max(1),
        });
        let worker = shared.clone();
        let handle = std::thread::spawn(move || {
            let _guard = FinishGuard(worker.clone());
            let mut version = version;
            loop {
                let weights = {
                    let mut s = worker.lock();
                    if s.stop {
                        return;
                    }
                    s.weights.take()
                };
                if let Some((v, w)) = weights {
                    if let Err(e) = load_snapshot(model.trainable(), &w) {
                        worker.lock().groups.push_back(Err(e.to_string()));
                        return;
                    }
                    version = v;
                }
                // A panic inside libtorch or a reward must reach the trainer as an error, not
                // leave it waiting.
                let batch = match catch_unwind(AssertUnwindSafe(|| producer.produce(&model.lm, version))) {
                    Ok(b) => b.map_err(|e| e.to_string()),
                    Err(panic) => Err(format!("generation panicked: {}", panic_message(panic.as_ref()))),
                };
                let (items, failed): (Vec<Result<QueuedGroup, String>>, bool) = match batch {
                    Ok(b) => (b.into_groups().into_iter().map(Ok).collect(), false),
                    Err(e) => (vec![Err(e)], true),
                };
                for item in items {
                    let mut s = worker.lock();
                    while s.groups.len() >= worker.capacity && !s.stop {
                        s = worker.changed.wait(s).unwrap_or_else(|p| p.into_inner());
                    }
                    if s.stop {
                        return;
                    }
                    s.groups.push_back(item);
                    worker.changed.notify_all();
                }
                if failed {
                    return;
                }
            }
        });
        AsyncRollouts {
            shared,
            handle: Some(handle),
            published: version,
            published_bytes: 0,
        }
    }

    /// Hands the generator a copy of `vs` (the policy's trained variables: with LoRA the
    /// adapter alone) as weight version `version`; it switches before its next batch (a newer
    /// publication replaces one not yet picked up).
    pub fn publish(&mut self, version: u64, vs: &VarStore) {
        let weights = snapshot(vs);
        self.published_bytes = weights
            .iter()
            .map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes())
            .sum();
        self.shared.lock().weights = Some((version, weights));
        self.published = version;
    }

    /// Bytes of the last weight sync (with LoRA: the adapter's tensors alone).
    pub fn published_bytes(&self) -> usize {
        self.published_bytes
    }

    /// The version last published.
    pub fn published(&self) -> u64 {
        self.published
    }

    /// Whether the generator's weights are more than `max_staleness` versions behind
    /// `version`: all it makes is dropped until weights are published to it.
    pub(crate) fn behind(&self, version: u64, max_staleness: u64) -> bool {
        version - self.published > max_staleness
    }

    /// Finished groups waiting.
    pub fn queued(&self) -> usize {
        self.shared.lock().groups.len()
    }

    /// The oldest finished group, waiting for one if the queue is empty.
    pub fn next(&self) -> Result<QueuedGroup, TrainError> {
        let mut s = self.shared.lock();
        loop {
            if let Some(b) = s.groups.pop_front() {
                self.shared.changed.notify_all();
                return b.map_err(TrainError::Worker);
            }
            if s.finished {
                return Err(TrainError::Worker("the generation thread stopped".into()));
            }
            s = self.shared.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits until `n` groups are queued (or the thread stopped); for tests and notebooks that
    /// want a full queue before stepping.
    pub fn wait_for(&self, n: usize) {
        let mut s = self.shared.lock();
        while s.groups.len() < n.min(self.shared.capacity) && !s.finished {
            s = self.shared.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for AsyncRollouts {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
