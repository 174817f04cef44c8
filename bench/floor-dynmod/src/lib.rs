//! # kvroute-floor-dynmod
//!
//! The native build's routing floor in `make bench-overhead` (see `docs/overhead.md`): an
//! Envoy dynamic module that routes by the request body the way kvroute-native does, doing
//! only what that takes and no decision. Per request it
//! 1. pauses at the request headers while a body follows (`StopIteration`),
//! 2. lets Envoy buffer the body until it is whole (`StopIterationAndBuffer`),
//! 3. copies the body out of Envoy's slices into one buffer per worker thread, once (as
//!    kvroute-native does before it analyses it),
//! 4. sets one fixed routing header and clears the route cache, so Envoy resolves the route
//!    again and sends the request where the header says (as kvroute-native's decision does),
//! 5. continues.
//!
//! No parsing, no metrics, no shared state; no allocation per request once the worker's
//! buffer has grown to the body size (the chunk list goes to the heap past 8 chunks, as
//! kvroute-native's: `kvroute_dynmod_abi::append_chunks`). Envoy's own buffer
//! filter (the benchmark's `floor-native`) is the floor of reading the body without a
//! module; this is the floor of *hosting a routing module*: the dynamic-module hooks and
//! callbacks, the copy, the routing header and the second route resolution. kvroute-native's
//! cost over this one is its decision and its glue.
//!
//! The filter config (`filter_config`, a `StringValue`) is the header to set, `name: value`
//! (`x-kvroute-cluster: c0`); a config that is not a valid header (no colon, a name that is
//! not a field name or is a framing or host header, a value with control bytes) is refused
//! (Envoy then refuses the listener: "Failed to initialize dynamic module").
//!
//! ABI: Envoy 1.40.0's dynamic-module ABI `v0.2.0`
//! (`source/extensions/dynamic_modules/abi/abi.h`; the declarations below mirror the ones of
//! `dynmod/src/abi.rs`, which cites the header's commit and checks them against the binary's
//! exports). This crate declares only the five callbacks it calls.

#![allow(unsafe_code)] // The FFI boundary with Envoy; see the SAFETY notes.

use std::cell::RefCell;
use std::ffi::c_void;

use kvroute_dynmod_abi::{Buf, BUFFERED_REQUEST_BODY, RECEIVED_REQUEST_BODY, REQUEST_HEADERS};

/// Every status enumeration's `Continue`.
const CONTINUE: u32 = 0;
/// `..._request_headers_status_StopIteration` and `..._request_body_status_StopIterationAndBuffer`.
const STOP: u32 = 1;

extern "C" {
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(f: *mut c_void, body: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        f: *mut c_void,
        body: u32,
        result: *mut Buf,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_received_buffered_request_body(f: *mut c_void) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        f: *mut c_void,
        header_type: u32,
        key: Buf,
        value: Buf,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_clear_route_cache(f: *mut c_void);
}

/// The routing header every request gets: the filter config, split at its first colon.
struct Config {
    name: Vec<u8>,
    value: Vec<u8>,
}

/// Headers the floor may not set: framing and the authority (setting them would change the
/// request, not route it).
const REFUSED_NAMES: [&[u8]; 4] = [b"content-length", b"transfer-encoding", b"host", b"te"];

impl Config {
    /// `name: value` (blanks around either trimmed). `None` (the config refused) without a
    /// colon, or when the name is not an HTTP field name (RFC 9110 §5.1: a token, one or
    /// more of `!#$%&'*+-.^_`|~`, digits and letters; so no pseudo-header) or one of
    /// [`REFUSED_NAMES`], or when the value holds anything but visible ASCII, spaces and
    /// tabs (§5.5). Envoy would refuse such a header on every request (503).
    fn parse(config: &[u8]) -> Option<Config> {
        let colon = config.iter().position(|&b| b == b':')?;
        let (name, value) = (config.get(..colon)?, config.get(colon + 1..)?);
        let name = name.trim_ascii().to_ascii_lowercase();
        let value = value.trim_ascii();
        let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        let field_byte = |b: u8| b == b'\t' || (b' '..=b'~').contains(&b);
        (!name.is_empty()
            && name.iter().all(|&b| tchar(b))
            && !REFUSED_NAMES.contains(&name.as_slice())
            && value.iter().all(|&b| field_byte(b)))
        .then(|| Config {
            name,
            value: value.to_vec(),
        })
    }
}

thread_local! {
    /// The body's copy, one buffer per worker thread, its capacity kept between requests.
    static BODY: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Append the chunks of body `kind` of filter `f` to `out`.
///
/// SAFETY: `f` is a live filter, inside one of its hooks.
unsafe fn copy_body(f: *mut c_void, kind: u32, out: &mut Vec<u8>) {
    // SAFETY: the caller's contract.
    let n = unsafe { envoy_dynamic_module_callback_http_get_body_chunks_size(f, kind) };
    // SAFETY: Envoy fills the n chunks it just counted, valid until the end of this hook.
    unsafe {
        kvroute_dynmod_abi::append_chunks(
            n,
            |v| envoy_dynamic_module_callback_http_get_body_chunks(f, kind, v),
            out,
        );
    }
}

/// `envoy_dynamic_module_on_program_init`: the ABI version string (Envoy 1.40.0's).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    kvroute_dynmod_abi::ABI_VERSION.as_ptr().cast()
}

/// `on_http_filter_config_new(filter_config_envoy_ptr, name, config)`: the [`Config`], or
/// null (refused) when the config is not `name: value`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _envoy: *mut c_void,
    _name: Buf,
    config: Buf,
) -> *mut c_void {
    // SAFETY: Envoy's buffers are valid for this hook.
    match Config::parse(unsafe { config.bytes() }) {
        Some(c) => Box::into_raw(Box::new(c)).cast(),
        None => std::ptr::null_mut(),
    }
}

/// `on_http_filter_config_destroy(config_module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *mut c_void) {
    if !config.is_null() {
        // SAFETY: made by Box::into_raw in config_new; Envoy destroys it once, after its
        // filters.
        drop(unsafe { Box::from_raw(config.cast::<Config>()) });
    }
}

/// `on_http_filter_per_route_config_new`: none (null refuses one).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _n: Buf,
    _c: Buf,
) -> *mut c_void {
    std::ptr::null_mut()
}

/// `on_http_filter_per_route_config_destroy`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(_c: *mut c_void) {}

/// `on_http_filter_new(config_module_ptr, filter_envoy_ptr)`: the stream's module pointer is
/// the config itself (no per-stream state, no allocation).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *mut c_void,
    _envoy: *mut c_void,
) -> *mut c_void {
    config
}

/// `on_http_filter_request_headers`: wait for the body when one follows.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    _e: *mut c_void,
    _m: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    if end_of_stream {
        CONTINUE
    } else {
        STOP
    }
}

/// The body is whole: copy it, set the routing header, clear the route cache. Called only
/// from the body hook, whose contract (abi.h) makes `envoy` a live filter inside its hook
/// and `module` its module pointer (the config, from `on_http_filter_new`); private, so
/// nothing else can pass it other pointers.
fn route(envoy: *mut c_void, module: *mut c_void) {
    BODY.with(|b| {
        let Ok(mut body) = b.try_borrow_mut() else {
            return;
        };
        body.clear();
        // SAFETY: `envoy` is this hook's live filter.
        unsafe {
            copy_body(envoy, BUFFERED_REQUEST_BODY, &mut body);
            if !envoy_dynamic_module_callback_http_received_buffered_request_body(envoy) {
                copy_body(envoy, RECEIVED_REQUEST_BODY, &mut body);
            }
        }
        std::hint::black_box(body.len());
    });
    // SAFETY: the module pointer is the config (on_http_filter_new), alive until its
    // filters are gone.
    if let Some(c) = unsafe { module.cast::<Config>().as_ref() } {
        // SAFETY: `envoy` is live; the buffers are valid for the call.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                envoy,
                REQUEST_HEADERS,
                Buf::of(&c.name),
                Buf::of(&c.value),
            );
            envoy_dynamic_module_callback_http_clear_route_cache(envoy);
        }
    }
}

/// `on_http_filter_request_body`: buffer until the body is whole; then copy it, set the
/// routing header, clear the route cache and continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: *mut c_void,
    module: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    if !end_of_stream {
        return STOP;
    }
    route(envoy, module);
    CONTINUE
}

/// `on_http_filter_request_trailers`: Continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _e: *mut c_void,
    _m: *mut c_void,
) -> u32 {
    CONTINUE
}

/// `on_http_filter_response_headers`: Continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _e: *mut c_void,
    _m: *mut c_void,
    _end_of_stream: bool,
) -> u32 {
    CONTINUE
}

/// `on_http_filter_response_body`: Continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _e: *mut c_void,
    _m: *mut c_void,
    _end_of_stream: bool,
) -> u32 {
    CONTINUE
}

/// `on_http_filter_response_trailers`: Continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _e: *mut c_void,
    _m: *mut c_void,
) -> u32 {
    CONTINUE
}

/// `on_http_filter_local_reply`: Continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_local_reply(
    _e: *mut c_void,
    _m: *mut c_void,
    _code: u32,
    _details: Buf,
    _reset: bool,
) -> u32 {
    CONTINUE
}

/// `on_http_filter_stream_complete`: nothing to do.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _e: *mut c_void,
    _m: *mut c_void,
) {
}

/// `on_http_filter_destroy`: nothing to free (the module pointer is the config's).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(_m: *mut c_void) {}

/// `on_http_filter_scheduled`: never scheduled.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _e: *mut c_void,
    _m: *mut c_void,
    _id: u64,
) {
}

// Hooks Envoy resolves when it loads any HTTP-filter module (callouts, streams, watermarks,
// config events), unused here as in kvroute's module: no-ops, from the shared list.
kvroute_dynmod_abi::export_unused_hooks!();
