//! kv-core's [`Memory`](kv_core::Memory) port over CUDA, through cudarc: KV pools in GPU
//! memory, in pinned host memory, or in plain host memory for machines with no GPU.
//!
//! [`CudaMemory`] allocates [`Region`](kv_core::Region)s of every
//! [`MemoryKind`](kv_core::MemoryKind), and each region carries what a transport needs to
//! register it: device memory registers with NIXL as VRAM with the GPU's ordinal as device id,
//! pinned and pageable host memory as DRAM. Reading bytes back for verification works for every
//! kind, device memory through a synchronous copy to the host.
//!
//! cudarc is built with dynamic loading, so this crate builds with no CUDA installed; the
//! driver (`libcuda.so`) is probed and loaded at the first pinned or device allocation, and a
//! machine without it, or without a device, gets [`MemoryError::Unavailable`](kv_core::MemoryError)
//! naming why, while host pools go on working. This crate knows nothing of NIXL: the region is
//! the whole interface between memory and transport.
//!
//! ```
//! use kv_core::{Memory, MemoryKind};
//! use kv_cuda::CudaMemory;
//!
//! let mut memory = CudaMemory::new();
//! let kind = match kv_cuda::cuda_device_count() {
//!     Ok(n) if n > 0 => MemoryKind::Device(0),
//!     _ => MemoryKind::Host,
//! };
//! let pool = memory.allocate(kind, 1 << 20).unwrap();
//! memory.write(pool.id, 4096, b"kv").unwrap();
//! let mut back = [0; 2];
//! memory.read(pool.id, 4096, &mut back).unwrap();
//! assert_eq!(&back, b"kv");
//! ```

mod driver;
mod memory;

pub use memory::CudaMemory;

/// The environment variable that asks for GPU checks outside the test harness (kv-demo's VRAM
/// bench): they run where it is `1` and a device exists. GPU tests need no variable: they are
/// `#[ignore = "needs a CUDA device"]`, and run with `--include-ignored` where there is one.
pub const GPU_TESTS_ENV: &str = "KVFLOW_GPU";

/// How many CUDA devices this process sees, or why it sees none (no driver, or the driver does
/// not initialise).
pub fn cuda_device_count() -> Result<u32, String> {
    driver::device_count()
}

/// The devices a GPU check asked for by [`GPU_TESTS_ENV`] may use, or why it cannot run:
/// `KVFLOW_GPU` is not `1`, or there is no CUDA device. The VRAM bench says the reason and
/// stops.
pub fn gpu_for_tests() -> Result<u32, String> {
    if std::env::var(GPU_TESTS_ENV).as_deref() != Ok("1") {
        return Err(format!("{GPU_TESTS_ENV} is not 1"));
    }
    match cuda_device_count() {
        Ok(0) => Err("no CUDA device".to_owned()),
        Ok(count) => Ok(count),
        Err(reason) => Err(format!("no CUDA device: {reason}")),
    }
}
