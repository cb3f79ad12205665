//! GPU pools on a real device: 256 MiB of VRAM written, read back, copied device to device and
//! checked byte for byte; pinned host memory; a device that is not there.
//!
//! Each needs a CUDA device, so each is `#[ignore = "needs a CUDA device"]`: `cargo test` reports
//! them as ignored, and on a machine with a GPU `cargo test -p kv-cuda -- --include-ignored`
//! runs them, as `crates/kv-demo/gpu/run.sh` does. Run there, they fail without a device.

use kv_core::{Memory, MemoryError, MemoryKind};
use kv_cuda::CudaMemory;

const POOL_BYTES: u64 = 256 << 20;

/// How many CUDA devices this machine has; at least one, or the test fails saying why.
fn devices() -> u32 {
    match kv_cuda::cuda_device_count() {
        Ok(0) => panic!("this test needs a CUDA device, and the driver sees none"),
        Ok(count) => count,
        Err(reason) => panic!("this test needs a CUDA device: {reason}"),
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ (i >> 11) ^ usize::from(seed)) as u8).collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_device_pool_of_256_mib_round_trips_and_copies_on_the_device() {
    devices();
    let mut memory = CudaMemory::new();
    let a = memory.allocate(MemoryKind::Device(0), POOL_BYTES).unwrap();
    let b = memory.allocate(MemoryKind::Device(0), POOL_BYTES).unwrap();
    assert_eq!(a.kind, MemoryKind::Device(0));
    assert_ne!(a.addr, 0);
    let mut back = vec![0xffu8; POOL_BYTES as usize];
    memory.read(b.id, 0, &mut back).unwrap();
    assert!(back.iter().all(|&byte| byte == 0), "a new device region is not zeroed");
    let bytes = pattern(7, POOL_BYTES as usize);
    memory.write(a.id, 0, &bytes).unwrap();
    memory.read(a.id, 0, &mut back).unwrap();
    assert!(back == bytes, "device bytes read back differ from those written");
    // Device to device, whole and at offsets.
    memory.copy(b.id, 0, a.id, 0, POOL_BYTES).unwrap();
    memory.read(b.id, 0, &mut back).unwrap();
    assert!(back == bytes, "the device-to-device copy differs");
    memory.copy(b.id, 4096, a.id, 1 << 20, 4096).unwrap();
    let mut page = vec![0u8; 4096];
    memory.read(b.id, 4096, &mut page).unwrap();
    assert_eq!(page, bytes[1 << 20..(1 << 20) + 4096]);
    let err = memory.copy(a.id, 0, a.id, 1, 16).unwrap_err();
    assert!(err.to_string().contains("overlapping ranges"), "{err}");
    memory.free(a.id).unwrap();
    memory.free(b.id).unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_pinned_host_pool_round_trips_and_copies_to_the_device() {
    devices();
    let mut memory = CudaMemory::new();
    let pinned = memory.allocate(MemoryKind::PinnedHost, 1 << 20).unwrap();
    let device = memory.allocate(MemoryKind::Device(0), 1 << 20).unwrap();
    let host = memory.allocate(MemoryKind::Host, 1 << 20).unwrap();
    let bytes = pattern(3, 1 << 20);
    memory.write(pinned.id, 0, &bytes).unwrap();
    // Pinned to device to pageable host, through the driver both times.
    memory.copy(device.id, 0, pinned.id, 0, 1 << 20).unwrap();
    memory.copy(host.id, 0, device.id, 0, 1 << 20).unwrap();
    let mut back = vec![0u8; 1 << 20];
    memory.read(host.id, 0, &mut back).unwrap();
    assert!(back == bytes, "pinned -> device -> host differs");
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_a_device_that_is_not_there_is_unavailable_by_ordinal() {
    let count = devices();
    let mut memory = CudaMemory::new();
    match memory.allocate(MemoryKind::Device(count), 4096) {
        Err(MemoryError::Unavailable { kind, reason }) => {
            assert_eq!(kind, MemoryKind::Device(count));
            assert_eq!(reason, format!("there is no CUDA device {count}: this machine has {count}"));
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // More than the device holds is an allocation error that names the driver's reason.
    match memory.allocate(MemoryKind::Device(0), 1 << 50) {
        Err(MemoryError::Allocation { reason, .. }) => assert!(reason.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{reason}"),
        other => panic!("expected an allocation error, got {other:?}"),
    }
}
