//! kvroute-sim: vLLM-compatible model-server simulator (issue 4).
