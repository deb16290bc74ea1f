//! What the bench binaries (`benches/`) time directly beside the public API: the decode
//! kernels and the huge-page allocation. Not part of treetrain's API; it may change with any
//! release.

pub use crate::model::cpu_kernels::{KERNEL_ROWS, decode_attention, product_up_to};
pub use crate::model::host_memory::{Placement, huge_page_empty};
