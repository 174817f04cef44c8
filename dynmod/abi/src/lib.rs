//! # kvroute-dynmod-abi
//!
//! What every Envoy dynamic module of this repository shares of the ABI, in one place:
//! kvroute's module (`dynmod/`, whose `abi` module declares the callbacks it calls and its
//! hooks) and the benchmark's routing floor (`bench/floor-dynmod/`).
//!
//! Source: `source/extensions/dynamic_modules/abi/abi.h` of Envoy 1.40.0's ABI `v0.2.0`
//! (the commit `dynmod/src/abi.rs` cites; `integration/tests/dynmod_e2e.rs` checks the
//! built module's exports and imports against the pip Envoy binary).
#![no_std]
#![allow(unsafe_code)] // Buf::bytes: a slice from Envoy's pointer and length.

extern crate alloc;
use alloc::vec::Vec;

/// Body chunks [`append_chunks`] lists on the stack (16 bytes each); more go to the heap.
const CHUNKS_ON_STACK: usize = 8;

/// Append to `out` the `n` buffers `list` fills in (Envoy's `get_body_chunks` given the
/// count its `get_body_chunks_size` returned): one reservation for the whole copy, the list
/// itself on the stack when it is short (a small body is one or two chunks). Nothing is
/// appended when `n` is 0 or `list` returns false.
///
/// # Safety
/// `list` writes at most `n` buffers to the pointer it is given, each valid for reads of its
/// length until this function returns (a body chunk is valid until the end of the hook).
pub unsafe fn append_chunks(n: usize, list: impl FnOnce(*mut Buf) -> bool, out: &mut Vec<u8>) {
    if n == 0 {
        return;
    }
    let mut stack = [Buf::NULL; CHUNKS_ON_STACK];
    let mut heap = Vec::new();
    let chunks: &mut [Buf] = match stack.get_mut(..n) {
        Some(s) => s,
        None => {
            heap.resize(n, Buf::NULL);
            &mut heap
        }
    };
    if list(chunks.as_mut_ptr()) {
        out.reserve(chunks.iter().map(|c| c.len).sum());
        for c in chunks.iter() {
            // SAFETY: the function's contract.
            out.extend_from_slice(unsafe { c.bytes() });
        }
    }
}

/// `envoy_dynamic_module_type_envoy_buffer` / `_module_buffer`: a pointer and a length,
/// bytes owned by whichever side the type's name says, valid for as long as the callback
/// or hook that hands it over says (abi.h).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Buf {
    /// The first byte; may be null (an empty buffer).
    pub ptr: *const u8,
    /// Length in bytes.
    pub len: usize,
}

impl Buf {
    /// The empty buffer (null, 0).
    pub const NULL: Buf = Buf {
        ptr: core::ptr::null(),
        len: 0,
    };

    /// A buffer over `b`, valid while `b` is.
    pub fn of(b: &[u8]) -> Buf {
        Buf {
            ptr: b.as_ptr(),
            len: b.len(),
        }
    }

    /// The bytes: empty when the pointer is null or the length 0.
    ///
    /// # Safety
    /// A non-null `ptr` is valid for reads of `len` bytes, unchanged, for `'a`.
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.len == 0 {
            &[]
        } else {
            // SAFETY: see the function's contract.
            unsafe { core::slice::from_raw_parts(self.ptr, self.len) }
        }
    }
}

/// `envoy_dynamic_module_type_http_header_type_RequestHeader`.
pub const REQUEST_HEADERS: u32 = 0;
/// `envoy_dynamic_module_type_http_body_type_ReceivedRequestBody`.
pub const RECEIVED_REQUEST_BODY: u32 = 0;
/// `envoy_dynamic_module_type_http_body_type_BufferedRequestBody`.
pub const BUFFERED_REQUEST_BODY: u32 = 1;

/// The ABI version string both modules return from `envoy_dynamic_module_on_program_init`:
/// Envoy 1.40.0's own (`ENVOY_DYNAMIC_MODULES_ABI_VERSION`); Envoy loads a module of another
/// version with a warning.
pub const ABI_VERSION: &core::ffi::CStr = c"v0.2.0";

/// Export, from the calling crate, each HTTP-filter hook that Envoy resolves when it loads
/// a module but kvroute's modules do not use (HTTP callouts and streams, downstream
/// watermarks, config-level events), as a no-op `extern "C" fn()`: their arguments are
/// ignored, so they are declared without them (the C calling convention lets a callee
/// ignore its arguments). Invoke once per module crate, at its top level.
#[macro_export]
macro_rules! export_unused_hooks {
    () => {
        $crate::export_unused_hooks!(
            envoy_dynamic_module_on_http_filter_http_callout_done,
            envoy_dynamic_module_on_http_filter_http_stream_headers,
            envoy_dynamic_module_on_http_filter_http_stream_data,
            envoy_dynamic_module_on_http_filter_http_stream_trailers,
            envoy_dynamic_module_on_http_filter_http_stream_complete,
            envoy_dynamic_module_on_http_filter_http_stream_reset,
            envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark,
            envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark,
            envoy_dynamic_module_on_http_filter_config_scheduled,
            envoy_dynamic_module_on_http_filter_config_http_callout_done,
            envoy_dynamic_module_on_http_filter_config_http_stream_headers,
            envoy_dynamic_module_on_http_filter_config_http_stream_data,
            envoy_dynamic_module_on_http_filter_config_http_stream_trailers,
            envoy_dynamic_module_on_http_filter_config_http_stream_complete,
            envoy_dynamic_module_on_http_filter_config_http_stream_reset,
        );
    };
    ($($name:ident),* $(,)?) => {
        $(
            #[doc = concat!("`", stringify!($name), "(...)`: unused.")]
            #[no_mangle]
            pub extern "C" fn $name() {}
        )*
    };
}
