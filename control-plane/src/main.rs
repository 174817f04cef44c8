//! kvroute-cp (skeleton; see issue 5).
fn main() {}
