//! # kvroute-floor-filter
//!
//! The floor of `make bench-overhead` (see `docs/overhead.md`): the least a body-reading
//! proxy-wasm filter can cost. It pauses the request until the whole body is buffered, copies
//! the body into the Wasm VM once (as kvroute does before it analyses it), and continues.
//! No parsing, no shared data, no headers. kvroute's extra cost over plain Envoy is judged
//! against this filter's: what Envoy's Wasm host and body buffering cost anyway.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

#[allow(unsafe_code)] // proxy_wasm::main! expands to the `_initialize` export.
mod entry {
    use super::{FloorRoot, LogLevel, RootContext};
    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(FloorRoot) });
    }}
}

struct FloorRoot;

impl Context for FloorRoot {}

impl RootContext for FloorRoot {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Floor { bytes: 0 }))
    }
}

/// One request: the body size last read, so the copy cannot be optimised away.
struct Floor {
    bytes: usize,
}

impl Context for Floor {}

impl HttpContext for Floor {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            Action::Continue
        } else {
            // Hold the headers until the body is complete, as kvroute does.
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        if let Some(body) = self.get_http_request_body(0, body_size) {
            self.bytes = std::hint::black_box(body.len());
        }
        Action::Continue
    }
}
