//! # kvroute-dynmod-hooks
//!
//! What every Envoy dynamic module of this repository shares about the ABI, in one place:
//! kvroute's module (`dynmod/`) and the benchmark's routing floor (`bench/floor-dynmod/`).
//!
//! Source: `source/extensions/dynamic_modules/abi/abi.h` of Envoy 1.40.0's ABI `v0.2.0`
//! (the commit `dynmod/src/abi.rs` cites; `integration/tests/dynmod_e2e.rs` checks the
//! built module's exports and imports against the pip Envoy binary).
#![no_std]

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
