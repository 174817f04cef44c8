//! The proxy-wasm host calls the filter makes, declared here rather than called through the
//! SDK's `proxy_wasm::hostcalls`.
//!
//! Why: each SDK wrapper turns every status it does not expect into `panic!`, and a panic in
//! Wasm kills the VM, and with it routing for every request on that worker until Envoy
//! restarts the plugin. The statuses a host may return are not closed: Envoy answers
//! `BadArgument` for a header map it no longer holds for the filter (found by a breaker:
//! the request headers after `resume_http_request`), and the ABI defines codes the SDK's
//! enum lacks (`Unimplemented`, 12), which it cannot even represent. The SDK's header
//! reads also unwrap UTF-8 on values HTTP allows to be any bytes ([`crate::headers`]).
//! Here every status is a plain `u32` and every call returns an `Option` or `Result` that
//! its caller handles; nothing panics.
//!
//! Signatures and status codes: proxy-wasm ABI v0.2.1
//! (<https://github.com/proxy-wasm/spec/tree/main/abi-versions/v0.2.1>), the version the
//! SDK (proxy-wasm 0.2) exports and Envoy 1.40 serves. Enumerations (map, buffer, stream,
//! metric and log types) travel as the `u32`s they are on the wire, so these declarations
//! have the same Wasm signatures as the SDK's and share its imports. The SDK still runs the
//! module's exports (context dispatch, `proxy_on_memory_allocate`); the filter makes no
//! host call through it.

#![allow(unsafe_code)] // Host imports and the buffers they hand over; see the SAFETY notes.

use std::fmt;

/// `Ok`: the call did what was asked.
const OK: u32 = 0;
/// `NotFound`: no such key, queue, property or buffer.
const NOT_FOUND: u32 = 1;
/// `Empty`: a shared queue holds nothing.
const EMPTY: u32 = 7;
/// `CasMismatch`: shared data changed since the CAS token was read.
pub const CAS_MISMATCH: u32 = 8;

/// A host call answered a status other than the ones its wrapper treats as a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failed(pub u32);

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Names from the ABI's `proxy_status_t`.
        let name = match self.0 {
            0 => "Ok",
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            5 => "BadExpression",
            6 => "InvalidMemoryAccess",
            7 => "Empty",
            8 => "CasMismatch",
            9 => "ResultMismatch",
            10 => "InternalFailure",
            11 => "BrokenConnection",
            12 => "Unimplemented",
            n => return write!(f, "status {n}"),
        };
        f.write_str(name)
    }
}

/// `Ok(())` on `Ok`, else the status.
fn ok(status: u32) -> Result<(), Failed> {
    if status == OK {
        Ok(())
    } else {
        Err(Failed(status))
    }
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_set_property(
        path_data: *const u8,
        path_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_register_shared_queue(
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_resolve_shared_queue(
        vm_id_data: *const u8,
        vm_id_size: usize,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_dequeue_shared_queue(
        queue_id: u32,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_enqueue_shared_queue(queue_id: u32, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
}

/// A buffer the host handed over: `Some` when the call returned `Ok` with data.
///
/// # Safety
/// `data` and `size` must be what a proxy-wasm host call wrote on `status`: on `Ok`, a
/// pointer to `size` bytes the host obtained from this module's `proxy_on_memory_allocate`
/// (the SDK's `allocator.rs`: a `Box<[u8]>` of exactly `size` bytes, leaked) and handed
/// over to the caller, or null.
unsafe fn take(status: u32, data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if status != OK || data.is_null() {
        return None;
    }
    // SAFETY: per this function's contract, a `Vec` of that pointer, length and capacity
    // has the allocation's layout, takes ownership back and frees it when dropped, as the
    // SDK's own wrappers do.
    Some(unsafe { Vec::from_raw_parts(data, size, size) })
}

/// Call `f` with two out-parameters for a returned buffer; the status and the buffer.
fn returning(f: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> (u32, Option<Vec<u8>>) {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    let status = f(&mut data, &mut size);
    // SAFETY: `data` and `size` are what the host call inside `f` wrote on `status` (every
    // caller passes them straight through to one import that returns a buffer).
    (status, unsafe { take(status, data, size) })
}

/// Write `msg` to Envoy's log at `level` (the ABI's log levels: 0 trace .. 5 critical).
pub fn log(level: u32, msg: &str) {
    // SAFETY: the message is valid for `msg.len()` bytes for the call.
    let _ = unsafe { proxy_log(level, msg.as_ptr(), msg.len()) };
}

/// The host's wall clock, Unix nanoseconds; `None` if the call fails.
pub fn now_ns() -> Option<u64> {
    let mut t: u64 = 0;
    // SAFETY: the host only writes the out-parameter, which is valid for writes.
    ok(unsafe { proxy_get_current_time_nanoseconds(&mut t) }).ok()?;
    Some(t)
}

/// Ask for `proxy_on_tick` every `ms` milliseconds (0: no tick).
pub fn set_tick_period_ms(ms: u32) -> Result<(), Failed> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

/// Up to `max` bytes of buffer `kind` (the ABI's buffer types: 0 request body, 1 response
/// body, 7 plugin configuration...) from byte `start`; `None` when it is absent, empty or
/// not readable now.
pub fn buffer(kind: u32, start: usize, max: usize) -> Option<Vec<u8>> {
    // SAFETY: the host only writes the two out-parameters, which are valid for writes.
    returning(|d, s| unsafe { proxy_get_buffer_bytes(kind, start, max, d, s) }).1
}

/// Header `key` of `map` (the ABI's map types: 0 request headers, 2 response headers...)
/// as bytes; `None` when absent or not readable now.
pub fn header_map_value(map: u32, key: &str) -> Option<Vec<u8>> {
    // SAFETY: the key is valid for `key.len()` bytes for the call; the host only writes the
    // two out-parameters, which are valid for writes.
    returning(|d, s| unsafe { proxy_get_header_map_value(map, key.as_ptr(), key.len(), d, s) }).1
}

/// Map `map` serialized as the host returns it ([`crate::headers::HeaderMap`]); empty when
/// the call fails (the map not readable now) or returns nothing.
pub fn header_map_pairs(map: u32) -> Vec<u8> {
    // SAFETY: the host only writes the two out-parameters, which are valid for writes.
    returning(|d, s| unsafe { proxy_get_header_map_pairs(map, d, s) })
        .1
        .unwrap_or_default()
}

/// Set header `key` of `map` to `value`, replacing any values it had.
pub fn replace_header(map: u32, key: &str, value: &[u8]) -> Result<(), Failed> {
    // SAFETY: key and value are valid for their lengths for the call.
    ok(unsafe {
        proxy_replace_header_map_value(map, key.as_ptr(), key.len(), value.as_ptr(), value.len())
    })
}

/// Remove header `key` from `map`.
pub fn remove_header(map: u32, key: &str) -> Result<(), Failed> {
    // SAFETY: the key is valid for `key.len()` bytes for the call.
    ok(unsafe { proxy_remove_header_map_value(map, key.as_ptr(), key.len()) })
}

/// A property path as the ABI takes it: the parts joined by NUL bytes.
fn property_path(path: &[&str]) -> Vec<u8> {
    path.join("\0").into_bytes()
}

/// Property `path` (e.g. `["node", "id"]`); `None` when absent or not readable.
pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    let p = property_path(path);
    // SAFETY: the path is valid for `p.len()` bytes for the call; the host only writes the
    // two out-parameters, which are valid for writes.
    returning(|d, s| unsafe { proxy_get_property(p.as_ptr(), p.len(), d, s) }).1
}

/// Set property `path` to `value` (Envoy's filter state).
pub fn set_property(path: &[&str], value: &[u8]) -> Result<(), Failed> {
    let p = property_path(path);
    // SAFETY: path and value are valid for their lengths for the call.
    ok(unsafe { proxy_set_property(p.as_ptr(), p.len(), value.as_ptr(), value.len()) })
}

/// Shared data `key`: its value and CAS token (`None` for a token of 0, which the ABI
/// reserves for "no token"); `(None, None)` when the key does not exist.
pub fn shared_data(key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), Failed> {
    let mut cas: u32 = 0;
    let cas_out: *mut u32 = &mut cas;
    // SAFETY: the key is valid for `key.len()` bytes for the call; the host only writes the
    // three out-parameters, which are valid for writes.
    let (status, value) =
        returning(|d, s| unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), d, s, cas_out) });
    match status {
        OK => Ok((value, (cas != 0).then_some(cas))),
        NOT_FOUND => Ok((None, None)),
        other => Err(Failed(other)),
    }
}

/// Write shared data `key`; with `cas`, only if the key's token still is `cas`
/// ([`CAS_MISMATCH`] otherwise).
pub fn set_shared_data(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Failed> {
    // SAFETY: key and value are valid for their lengths for the call.
    ok(unsafe {
        proxy_set_shared_data(
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
            cas.unwrap_or(0),
        )
    })
}

/// Register this VM's shared queue `name`; its id.
pub fn register_queue(name: &str) -> Result<u32, Failed> {
    let mut id: u32 = 0;
    // SAFETY: the name is valid for `name.len()` bytes for the call; the host only writes
    // the out-parameter, which is valid for writes.
    ok(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// The id of VM `vm_id`'s shared queue `name`; `None` when no VM registered it.
pub fn resolve_queue(vm_id: &str, name: &str) -> Result<Option<u32>, Failed> {
    let mut id: u32 = 0;
    // SAFETY: both strings are valid for their lengths for the call; the host only writes
    // the out-parameter, which is valid for writes.
    let status = unsafe {
        proxy_resolve_shared_queue(
            vm_id.as_ptr(),
            vm_id.len(),
            name.as_ptr(),
            name.len(),
            &mut id,
        )
    };
    match status {
        OK => Ok(Some(id)),
        NOT_FOUND => Ok(None),
        other => Err(Failed(other)),
    }
}

/// The next item of queue `id`; `None` when it is empty.
pub fn dequeue(id: u32) -> Result<Option<Vec<u8>>, Failed> {
    // SAFETY: the host only writes the two out-parameters, which are valid for writes.
    let (status, item) = returning(|d, s| unsafe { proxy_dequeue_shared_queue(id, d, s) });
    match status {
        OK => Ok(item),
        EMPTY => Ok(None),
        other => Err(Failed(other)),
    }
}

/// Append `data` to queue `id`.
pub fn enqueue(id: u32, data: &[u8]) -> Result<(), Failed> {
    // SAFETY: the data is valid for `data.len()` bytes for the call.
    ok(unsafe { proxy_enqueue_shared_queue(id, data.as_ptr(), data.len()) })
}

/// Let the paused request go on (the ABI's stream type 0, the HTTP request).
pub fn continue_request() -> Result<(), Failed> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_continue_stream(0) })
}

/// Answer the request from the filter: HTTP `status`, `headers` in the ABI's serialized
/// map layout ([`crate::headers::HeaderMap::as_bytes`]), `body`; no gRPC status (-1).
pub fn send_local_response(status: u32, headers: &[u8], body: &[u8]) -> Result<(), Failed> {
    // SAFETY: body and headers are valid for their lengths for the call; the details are
    // empty (a null pointer with size 0, as the ABI allows for empty strings).
    ok(unsafe {
        proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        )
    })
}

/// Make `context_id` the context the next host calls act on.
pub fn set_effective_context(context_id: u32) -> Result<(), Failed> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_set_effective_context(context_id) })
}

/// Define metric `name` of `kind` (the ABI's metric types: 0 counter, 1 gauge,
/// 2 histogram); its id.
pub fn define_metric(kind: u32, name: &str) -> Result<u32, Failed> {
    let mut id: u32 = 0;
    // SAFETY: the name is valid for `name.len()` bytes for the call; the host only writes
    // the out-parameter, which is valid for writes.
    ok(unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// Add `delta` to metric `id`.
pub fn increment_metric(id: u32, delta: i64) -> Result<(), Failed> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_increment_metric(id, delta) })
}

/// Set gauge `id` to `value`, or record `value` in histogram `id`.
pub fn record_metric(id: u32, value: u64) -> Result<(), Failed> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_record_metric(id, value) })
}
