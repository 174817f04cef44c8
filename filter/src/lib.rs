//! kvroute proxy-wasm filter (skeleton; see issue 3).
