//! Test harness: free ports, process supervision, real Envoy, recording backends (issue 3).
