//! The one module that calls the CUDA driver and owns raw memory: the driver's probe and
//! initialisation, device contexts, and allocations of each memory kind with their byte copies.
//!
//! Everything here is unsafe underneath (raw pointers, FFI); what it hands out is safe to use as
//! long as callers keep offsets within an allocation's length, which [`Allocation`] checks with
//! debug assertions and [`crate::CudaMemory`] checks always.
#![allow(unsafe_code)] // CUDA driver calls and raw host allocations: see the SAFETY notes.

use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, DriverError};

/// Host allocations are page-aligned, as NIXL and the GPU's copy engines like them.
pub(crate) const PAGE: usize = 4096;

/// A transparent huge page (x86-64, and aarch64 with 4 KiB pages). Host allocations of at
/// least this size start on one and ask the kernel for huge pages. The kernel's cross-process
/// copy, which UCX uses between host pools on one machine (CMA), walks and pins pages one at a
/// time; on huge pages it spends far less per byte: in kv-demo's transport bench it moved 8 to 11
/// GB/s instead of 4 to 5, about memcpy's speed.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// The driver's name and description of an error, as in `CUDA_ERROR_NO_DEVICE (no CUDA-capable
/// device is detected)`.
pub(crate) fn describe(e: DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(text) => format!("{name} ({})", text.to_string_lossy()),
        Err(_) => name,
    }
}

/// Initialises the driver once per process, or says why it cannot be.
pub(crate) fn init() -> Result<(), String> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // cudarc panics on its first driver call when libcuda is missing, so look first.
        // SAFETY: only opens and closes the library to see whether it loads.
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver on this machine (libcuda.so does not load)".into());
        }
        result::init().map_err(|e| format!("the CUDA driver does not initialise: {}", describe(e)))
    })
    .clone()
}

/// How many CUDA devices this process sees.
pub(crate) fn device_count() -> Result<u32, String> {
    init()?;
    let count = result::device::get_count().map_err(|e| format!("cannot count CUDA devices: {}", describe(e)))?;
    Ok(u32::try_from(count).unwrap_or(0))
}

/// A device's primary context, retained for as long as this lives.
#[derive(Debug)]
pub(crate) struct Context {
    ordinal: u32,
    device: sys::CUdevice,
    raw: sys::CUcontext,
}

// SAFETY: a CUDA context may be made current on any thread; this handle only names the retained
// primary context, and every use binds it to the calling thread first (`bind`).
unsafe impl Send for Context {}
// SAFETY: as for Send; the driver's context calls are thread-safe.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of device `ordinal`.
    pub(crate) fn retain(ordinal: u32) -> Result<Context, String> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(format!("there is no CUDA device {ordinal}: this machine has {count}"));
        }
        let device = result::device::get(ordinal as i32)
            .map_err(|e| format!("cannot open CUDA device {ordinal}: {}", describe(e)))?;
        // SAFETY: `device` came from cuDeviceGet; the retain is released in Drop.
        let raw = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| format!("cannot retain the context of CUDA device {ordinal}: {}", describe(e)))?;
        Ok(Context { ordinal, device, raw })
    }

    /// Makes this context current on the calling thread, as the driver calls below need.
    fn bind(&self) -> Result<(), String> {
        // SAFETY: `raw` is a primary context retained until Drop.
        unsafe { result::ctx::set_current(self.raw) }
            .map_err(|e| format!("cannot bind the context of CUDA device {}: {}", self.ordinal, describe(e)))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `device` came from cuDeviceGet and its primary context was retained once here.
        if let Err(e) = unsafe { result::primary_ctx::release(self.device) } {
            tracing::warn!(device = self.ordinal, error = %describe(e), "cannot release a CUDA context");
        }
    }
}

/// Memory of one kind, owned until dropped, zeroed when made.
#[derive(Debug)]
pub(crate) enum Allocation {
    /// Pageable host memory: an anonymous private mapping of `map_len` bytes (`len` rounded
    /// up to pages).
    Host { ptr: NonNull<u8>, len: usize, map_len: usize },
    /// Page-locked host memory from `cuMemHostAlloc`, pinned for every context.
    Pinned { ptr: NonNull<u8>, len: usize, ctx: Arc<Context> },
    /// Device memory from `cuMemAlloc`.
    Device { ptr: sys::CUdeviceptr, len: usize, ctx: Arc<Context> },
}

// SAFETY: an Allocation owns its memory alone; its pointers are never shared, and device calls
// bind the context on the calling thread first.
unsafe impl Send for Allocation {}

impl Allocation {
    /// `len` zeroed, page-aligned bytes of host memory, populated; from [`HUGE_PAGE`] bytes
    /// on, aligned to a huge page and advised to be backed by huge pages (the kernel may still
    /// decline, as where transparent huge pages are off; the memory works the same, only slower
    /// to copy).
    pub(crate) fn host(len: usize) -> Result<Allocation, String> {
        if len == 0 {
            return Err("a region of 0 bytes".to_owned());
        }
        let huge = len >= HUGE_PAGE;
        let align = if huge { HUGE_PAGE } else { PAGE };
        let too_large = || format!("a host region of {len} bytes is larger than the address space");
        let map_len = len.checked_next_multiple_of(PAGE).ok_or_else(too_large)?;
        // Map enough to find an aligned start inside, then give back what is outside it.
        let reserve = map_len.checked_add(align - PAGE).ok_or_else(too_large)?;
        let (protection, flags) = (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS);
        // SAFETY: a new anonymous mapping, backed by no file, that nothing else refers to.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), reserve, protection, flags, -1, 0) };
        if base == libc::MAP_FAILED {
            let error = std::io::Error::last_os_error();
            return Err(format!("cannot map {reserve} bytes of host memory: {error}"));
        }
        let base = base as usize;
        let start = base.next_multiple_of(align);
        let (head, tail) = (start - base, base + reserve - (start + map_len));
        // SAFETY: both ranges lie inside the mapping just made and outside [start, start + map_len),
        // which is all that is kept; munmap of a page-aligned part of a mapping is allowed.
        unsafe {
            if head > 0 {
                libc::munmap(base as *mut libc::c_void, head);
            }
            if tail > 0 {
                libc::munmap((start + map_len) as *mut libc::c_void, tail);
            }
        }
        // SAFETY: [start, start + map_len) is mapped, and no page of it has been touched yet, so
        // each first touch can fault in a whole huge page.
        if huge && unsafe { libc::madvise(start as *mut libc::c_void, map_len, libc::MADV_HUGEPAGE) } != 0 {
            let error = std::io::Error::last_os_error();
            tracing::debug!(len, %error, "no transparent huge pages for a host region");
        }
        let ptr = NonNull::new(start as *mut u8).ok_or_else(|| "mmap returned address 0".to_owned())?;
        // Fault every page in now (with huge pages, one fault per 2 MiB), so that no transfer
        // into the pool pays for it later: first touches cost the kernel a zeroed page each,
        // and for huge pages possibly a compaction, which took demo transfers to 0.5 s.
        for offset in (0..map_len).step_by(PAGE) {
            // SAFETY: `offset` is inside the mapping, which is zero already; writing a zero
            // changes no byte and faults the page in.
            unsafe { ptr.as_ptr().add(offset).write_volatile(0) };
        }
        Ok(Allocation::Host { ptr, len, map_len })
    }

    /// `len` zeroed bytes of page-locked host memory.
    pub(crate) fn pinned(len: usize, ctx: Arc<Context>) -> Result<Allocation, String> {
        ctx.bind()?;
        // SAFETY: a context is current; the pointer is freed with cuMemFreeHost in Drop.
        let raw = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(describe)?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| "cuMemHostAlloc returned null".to_owned())?;
        // SAFETY: the driver just allocated `len` bytes at `ptr`, which nothing else uses yet.
        unsafe { ptr.as_ptr().write_bytes(0, len) };
        Ok(Allocation::Pinned { ptr, len, ctx })
    }

    /// `len` zeroed bytes of memory on the context's device.
    pub(crate) fn device(len: usize, ctx: Arc<Context>) -> Result<Allocation, String> {
        ctx.bind()?;
        // SAFETY: a context is current; the pointer is freed with cuMemFree in Drop.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(describe)?;
        let allocation = Allocation::Device { ptr, len, ctx };
        // A device memset runs asynchronously to the host: wait for it, so that a peer reading
        // through NIXL from now on sees zeros.
        // SAFETY: `ptr` holds `len` bytes on the current context's device.
        unsafe { result::memset_d8_sync(ptr, 0, len) }
            .and_then(|()| result::ctx::synchronize())
            .map_err(|e| format!("cannot zero the allocation: {}", describe(e)))?;
        Ok(allocation)
    }

    /// The address of the first byte (a device address for device memory).
    pub(crate) fn addr(&self) -> u64 {
        match self {
            Allocation::Host { ptr, .. } | Allocation::Pinned { ptr, .. } => ptr.as_ptr() as u64,
            Allocation::Device { ptr, .. } => *ptr,
        }
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        match self {
            Allocation::Host { len, .. } | Allocation::Pinned { len, .. } | Allocation::Device { len, .. } => *len,
        }
    }

    fn check(&self, offset: usize, len: usize) {
        debug_assert!(offset.checked_add(len).is_some_and(|end| end <= self.len()), "range checked by the caller");
    }

    /// Copies the bytes at `offset` into `out`; device memory through a synchronous copy.
    pub(crate) fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), String> {
        self.check(offset, out.len());
        match self {
            Allocation::Host { ptr, .. } | Allocation::Pinned { ptr, .. } => {
                // SAFETY: offset + out.len() is within the allocation (checked by the caller), and
                // `out` is a distinct Rust buffer.
                unsafe { ptr.as_ptr().add(offset).copy_to_nonoverlapping(out.as_mut_ptr(), out.len()) };
                Ok(())
            }
            Allocation::Device { ptr, ctx, .. } => {
                ctx.bind()?;
                // SAFETY: the device range is within the allocation and `out` has room for it;
                // a copy to pageable host memory returns once the bytes are there.
                unsafe { result::memcpy_dtoh_sync(out, ptr + offset as u64) }
                    .map_err(|e| format!("the copy from the device failed: {}", describe(e)))
            }
        }
    }

    /// Copies `data` to `offset`; device memory through a synchronous copy.
    pub(crate) fn write(&mut self, offset: usize, data: &[u8]) -> Result<(), String> {
        self.check(offset, data.len());
        match self {
            Allocation::Host { ptr, .. } | Allocation::Pinned { ptr, .. } => {
                // SAFETY: offset + data.len() is within the allocation (checked by the caller),
                // and `data` is a distinct Rust buffer.
                unsafe { ptr.as_ptr().add(offset).copy_from_nonoverlapping(data.as_ptr(), data.len()) };
                Ok(())
            }
            Allocation::Device { ptr, ctx, .. } => {
                ctx.bind()?;
                // SAFETY: the device range is within the allocation; the copy from pageable host
                // memory has read `data` when it returns, and a synchronize below makes sure the
                // bytes are on the device before a peer can be told to read them.
                unsafe { result::memcpy_htod_sync(*ptr + offset as u64, data) }
                    .and_then(|()| result::ctx::synchronize())
                    .map_err(|e| format!("the copy to the device failed: {}", describe(e)))
            }
        }
    }

    /// The context that device copies involving this allocation run in, if it has one.
    fn context(&self) -> Option<&Arc<Context>> {
        match self {
            Allocation::Host { .. } => None,
            Allocation::Pinned { ctx, .. } | Allocation::Device { ctx, .. } => Some(ctx),
        }
    }

    fn is_device(&self) -> bool {
        matches!(self, Allocation::Device { .. })
    }
}

/// Copies `len` bytes from `src` at `src_offset` to `dst` at `dst_offset`, and returns once they
/// are there; the allocations may be of any kinds, device memory going through the driver.
pub(crate) fn copy(
    dst: &mut Allocation,
    dst_offset: usize,
    src: &Allocation,
    src_offset: usize,
    len: usize,
) -> Result<(), String> {
    dst.check(dst_offset, len);
    src.check(src_offset, len);
    if !dst.is_device() && !src.is_device() {
        // SAFETY: both ranges are within their allocations (checked by the caller), and `dst`
        // is borrowed mutably, so it is a different allocation from `src`.
        unsafe {
            let from = (src.addr() as usize + src_offset) as *const u8;
            let to = (dst.addr() as usize + dst_offset) as *mut u8;
            to.copy_from_nonoverlapping(from, len);
        }
        return Ok(());
    }
    let ctx = if dst.is_device() { dst.context() } else { src.context() };
    ctx.ok_or_else(|| "a device copy without a context".to_owned())?.bind()?;
    // SAFETY: both ranges are within live allocations of this process; with unified addressing
    // cuMemcpy finds each side's kind from its address, and the synchronize waits for the copy,
    // which the driver may run asynchronously between device memory.
    unsafe { sys::cuMemcpy(dst.addr() + dst_offset as u64, src.addr() + src_offset as u64, len).result() }
        .and_then(|()| result::ctx::synchronize())
        .map_err(|e| format!("the copy failed: {}", describe(e)))
}

/// Copies within one allocation, between ranges that may overlap, and returns once it is done.
pub(crate) fn copy_within(allocation: &mut Allocation, dst: usize, src: usize, len: usize) -> Result<(), String> {
    allocation.check(dst, len);
    allocation.check(src, len);
    let overlap = dst < src + len && src < dst + len;
    match allocation {
        Allocation::Host { ptr, .. } | Allocation::Pinned { ptr, .. } => {
            // SAFETY: both ranges are within the allocation; `copy` is memmove, overlap allowed.
            unsafe { ptr.as_ptr().add(src).copy_to(ptr.as_ptr().add(dst), len) };
            Ok(())
        }
        Allocation::Device { .. } if overlap => {
            Err("overlapping ranges within one device region cannot be copied in one step".to_owned())
        }
        Allocation::Device { ptr, ctx, .. } => {
            ctx.bind()?;
            // SAFETY: both ranges are within the allocation and do not overlap; the synchronize
            // waits for the copy, which runs asynchronously to the host.
            unsafe { result::memcpy_dtod_sync(*ptr + dst as u64, *ptr + src as u64, len) }
                .and_then(|()| result::ctx::synchronize())
                .map_err(|e| format!("the copy failed: {}", describe(e)))
        }
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let freed = match self {
            Allocation::Host { ptr, map_len, .. } => {
                // SAFETY: the mapping made in `host`, of this length, unmapped once.
                match unsafe { libc::munmap(ptr.as_ptr().cast(), *map_len) } {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error().to_string()),
                }
            }
            Allocation::Pinned { ptr, ctx, .. } => ctx.bind().and_then(|()| {
                // SAFETY: allocated by cuMemHostAlloc, freed once.
                unsafe { result::free_host(ptr.as_ptr().cast()) }.map_err(describe)
            }),
            Allocation::Device { ptr, ctx, .. } => ctx.bind().and_then(|()| {
                // SAFETY: allocated by cuMemAlloc, freed once.
                unsafe { result::free_sync(*ptr) }.map_err(describe)
            }),
        };
        if let Err(error) = freed {
            tracing::warn!(addr = self.addr(), len = self.len(), %error, "cannot free CUDA memory");
        }
    }
}
