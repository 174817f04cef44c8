//! The engine model: one simulated model-server replica in virtual time.
//!
//! A discrete-step simulation of vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py):
//!
//! 1. **Running first.** Each running request gets its next tokens: the rest of its prompt
//!    (chunked prefill, capped by the step's token budget `max_num_batched_tokens`) or one
//!    decode token. If the [`BlockPool`] cannot supply the blocks, the lowest-ranked running
//!    request (the last admitted under FCFS; the worst `(priority, arrival)` under priority
//!    scheduling) is **preempted by recompute**: its blocks are freed, its progress reset, and
//!    it goes back to the head of the waiting queue.
//! 2. **Then waiting**, if nothing was preempted this step: requests are admitted in queue
//!    order (FCFS, or `(priority, arrival)` when priority scheduling is on) while there is
//!    token budget, fewer than `max_num_seqs` are running, and blocks are available. On
//!    admission the prompt's block hashes are looked up in the prefix cache; hit blocks are
//!    reused and skip prefill (at most `num_tokens − 1` tokens can hit, as in vLLM).
//! 3. The step's duration comes from [`StepTimeModel`]; virtual time advances by it. A
//!    request whose computed tokens catch up with its tokens emits one output token; full
//!    prompt blocks are registered in the prefix cache as they fill.
//!
//! Token accounting follows vLLM: a request has `num_tokens = prompt + generated` and
//! `num_computed` (tokens whose KV is in the cache); it holds ⌈computed / block_size⌉ blocks.
//! The last generated token's KV is never computed, so a finished request held
//! `prompt + output − 1` tokens.
//!
//! Deterministic: no clock and no randomness; the same calls give the same events.

use std::collections::{BTreeMap, HashMap};

use super::kv::{BlockId, BlockPool};
use super::perf::{BatchShape, StepTimeModel};

/// Engine configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// KV cache blocks (see [`super::perf::num_gpu_blocks`]).
    pub num_gpu_blocks: u32,
    /// Tokens per KV block (vLLM default 16).
    pub block_size: u32,
    /// Token budget per step (vLLM V1 default 8192 for the OpenAI server on ≥70 GiB GPUs,
    /// vllm/engine/arg_utils.py `default_max_num_batched_tokens`).
    pub max_num_batched_tokens: u32,
    /// Running-request cap (vLLM V1 default 1024 on ≥70 GiB GPUs, same file).
    pub max_num_seqs: u32,
    /// Serve by `(priority, arrival)` instead of arrival (vLLM `--scheduling-policy priority`).
    pub priority_scheduling: bool,
    /// Step-time coefficients.
    pub step: StepTimeModel,
}

/// A request handed to the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRequest {
    /// Caller-chosen unique id.
    pub id: u64,
    /// Prompt length in tokens (≥ 1).
    pub prompt_tokens: u32,
    /// Tokens to generate (≥ 1); the request finishes after exactly this many.
    pub output_tokens: u32,
    /// Chain hashes of the prompt's full blocks (see [`super::kv::chain_hashes`]); may be
    /// shorter than `prompt_tokens / block_size` (the rest is then never cached).
    pub block_hashes: Vec<u64>,
    /// vLLM priority: lower is served first (used only with priority scheduling).
    pub priority: i32,
}

/// Something that happened to a request during a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EngineEvent {
    /// An output token was produced at virtual time `time` (seconds). `index` counts from 1.
    Token {
        /// Request id.
        id: u64,
        /// Virtual time of the end of the step that produced it (seconds).
        time: f64,
        /// 1-based output token index.
        index: u32,
        /// True for the request's last token (the request is then finished and freed).
        last: bool,
    },
    /// The request was admitted from the waiting queue with `cached_tokens` prefix-cache hits.
    Admitted {
        /// Request id.
        id: u64,
        /// Virtual time at the start of the step (seconds).
        time: f64,
        /// Prompt tokens found in the prefix cache.
        cached_tokens: u32,
    },
    /// The request was preempted (its blocks freed; it will be recomputed).
    Preempted {
        /// Request id.
        id: u64,
        /// Virtual time (seconds).
        time: f64,
    },
}

/// A request the engine refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// `prompt_tokens` or `output_tokens` is zero.
    #[error("request {id}: prompt and output must each be at least one token")]
    Empty {
        /// Request id.
        id: u64,
    },
    /// The request can never fit the KV cache, even alone.
    #[error("request {id} needs {needed_blocks} KV blocks; the cache has {num_blocks}")]
    TooLarge {
        /// Request id.
        id: u64,
        /// Blocks the full sequence needs.
        needed_blocks: u64,
        /// Blocks in the pool.
        num_blocks: u32,
    },
    /// The id is already in use.
    #[error("request id {id} is already in the engine")]
    DuplicateId {
        /// Request id.
        id: u64,
    },
}

/// Cumulative engine counters (monotonic), the source of the `/metrics` counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct EngineCounters {
    /// Prompt tokens looked up in the prefix cache (`vllm:prefix_cache_queries`).
    pub prefix_queries_tokens: u64,
    /// Of those, tokens found (`vllm:prefix_cache_hits`).
    pub prefix_hit_tokens: u64,
    /// Preemptions (`vllm:num_preemptions`).
    pub preemptions: u64,
    /// Prefill tokens computed, recomputation included (`vllm:prompt_tokens`).
    pub prompt_tokens: u64,
    /// Output tokens produced (`vllm:generation_tokens`).
    pub generation_tokens: u64,
    /// Finished requests.
    pub finished: u64,
    /// Aborted requests.
    pub aborted: u64,
    /// Steps run.
    pub steps: u64,
    /// Virtual seconds spent in prefill-carrying steps.
    pub prefill_seconds: f64,
    /// Virtual seconds spent in decode-only steps.
    pub decode_seconds: f64,
}

#[derive(Debug, Clone)]
struct ReqState {
    req: SimRequest,
    arrival_seq: u64,
    generated: u32,
    computed: u32,
    blocks: Vec<BlockId>,
    /// Full prompt blocks already registered in the cache.
    registered: usize,
    running: bool,
}

impl ReqState {
    fn num_tokens(&self) -> u32 {
        self.req.prompt_tokens.saturating_add(self.generated)
    }
}

/// Outcome of [`Engine::step`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    /// Step duration (virtual seconds).
    pub duration: f64,
    /// The batch that ran.
    pub shape: BatchShape,
    /// Events, in order.
    pub events: Vec<EngineEvent>,
}

/// One simulated replica. See the module doc for the algorithm.
#[derive(Debug, Clone)]
pub struct Engine {
    cfg: EngineConfig,
    pool: BlockPool,
    now: f64,
    next_seq: u64,
    reqs: HashMap<u64, ReqState>,
    /// Waiting queue keyed by (priority or 0, arrival sequence).
    waiting: BTreeMap<(i32, u64), u64>,
    running: Vec<u64>,
    counters: EngineCounters,
}

impl Engine {
    /// An idle engine at virtual time 0.
    pub fn new(cfg: EngineConfig) -> Self {
        Self {
            pool: BlockPool::new(cfg.num_gpu_blocks),
            cfg,
            now: 0.0,
            next_seq: 0,
            reqs: HashMap::new(),
            waiting: BTreeMap::new(),
            running: Vec::new(),
            counters: EngineCounters::default(),
        }
    }

    /// Configuration in force.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Current virtual time (seconds).
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Move virtual time forward to `t` (no-op if `t` is not later). Used when idle.
    pub fn advance_to(&mut self, t: f64) {
        if t > self.now {
            self.now = t;
        }
    }

    /// Requests running (admitted, holding KV blocks).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting (never admitted, or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// True when there is nothing to do.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// KV cache usage, 0..1 (vLLM V1 formula, see [`BlockPool::usage`]).
    pub fn kv_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Tokens whose KV is held by running requests.
    pub fn used_tokens(&self) -> u64 {
        self.running
            .iter()
            .filter_map(|id| self.reqs.get(id))
            .map(|r| u64::from(r.computed))
            .sum()
    }

    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Cumulative counters.
    pub fn counters(&self) -> EngineCounters {
        self.counters
    }

    /// Progress of a request; `None` when unknown or finished.
    pub fn progress(&self, id: u64) -> Option<RequestProgress> {
        self.reqs.get(&id).map(|r| RequestProgress {
            prompt_tokens: r.req.prompt_tokens,
            output_tokens: r.req.output_tokens,
            computed: r.computed,
            generated: r.generated,
            running: r.running,
        })
    }

    /// Ids of the running requests, in scheduling order.
    pub fn running_ids(&self) -> &[u64] {
        &self.running
    }

    /// Queue a request. Errors: [`SubmitError`] for empty requests, duplicate ids, and
    /// sequences that could never fit the cache.
    pub fn submit(&mut self, req: SimRequest) -> Result<(), SubmitError> {
        if req.prompt_tokens == 0 || req.output_tokens == 0 {
            return Err(SubmitError::Empty { id: req.id });
        }
        if self.reqs.contains_key(&req.id) {
            return Err(SubmitError::DuplicateId { id: req.id });
        }
        let total = u64::from(req.prompt_tokens) + u64::from(req.output_tokens);
        let needed_blocks = total.div_ceil(u64::from(self.cfg.block_size.max(1)));
        if needed_blocks > u64::from(self.cfg.num_gpu_blocks) {
            return Err(SubmitError::TooLarge {
                id: req.id,
                needed_blocks,
                num_blocks: self.cfg.num_gpu_blocks,
            });
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let key = (self.prio_key(req.priority), seq);
        let id = req.id;
        self.reqs.insert(
            id,
            ReqState {
                req,
                arrival_seq: seq,
                generated: 0,
                computed: 0,
                blocks: Vec::new(),
                registered: 0,
                running: false,
            },
        );
        self.waiting.insert(key, id);
        Ok(())
    }

    fn prio_key(&self, priority: i32) -> i32 {
        if self.cfg.priority_scheduling {
            priority
        } else {
            0
        }
    }

    /// Remove a request (client went away). Its blocks are released. Returns whether it was
    /// present.
    pub fn abort(&mut self, id: u64) -> bool {
        let Some(mut st) = self.reqs.remove(&id) else {
            return false;
        };
        let key = (self.prio_key(st.req.priority), st.arrival_seq);
        self.waiting.remove(&key);
        self.running.retain(|r| *r != id);
        self.pool.release(&st.blocks);
        st.blocks.clear();
        self.counters.aborted += 1;
        true
    }

    /// Pick the preemption victim among running requests.
    fn victim(&self) -> Option<u64> {
        if self.cfg.priority_scheduling {
            self.running
                .iter()
                .filter_map(|id| {
                    self.reqs
                        .get(id)
                        .map(|r| (r.req.priority, r.arrival_seq, *id))
                })
                .max()
                .map(|(_, _, id)| id)
        } else {
            self.running.last().copied()
        }
    }

    fn preempt(&mut self, id: u64, events: &mut Vec<EngineEvent>) {
        self.running.retain(|r| *r != id);
        let key = match self.reqs.get_mut(&id) {
            Some(st) => {
                self.pool.release(&st.blocks);
                st.blocks.clear();
                st.computed = 0;
                st.registered = 0;
                st.running = false;
                (
                    if self.cfg.priority_scheduling {
                        st.req.priority
                    } else {
                        0
                    },
                    st.arrival_seq,
                )
            }
            None => return,
        };
        self.waiting.insert(key, id);
        self.counters.preemptions += 1;
        events.push(EngineEvent::Preempted { id, time: self.now });
    }

    fn blocks_needed(&self, st: &ReqState, upto_tokens: u32) -> u32 {
        let bs = self.cfg.block_size.max(1);
        upto_tokens
            .div_ceil(bs)
            .saturating_sub(st.blocks.len() as u32)
    }

    /// Run one step at the current virtual time. Returns `None` when idle (nothing runs and
    /// nothing can be admitted).
    pub fn step(&mut self) -> Option<StepReport> {
        if self.is_idle() {
            return None;
        }
        let mut budget = self.cfg.max_num_batched_tokens.max(1);
        let mut events = Vec::new();
        // (id, new tokens) scheduled this step.
        let mut scheduled: Vec<(u64, u32)> = Vec::new();
        let mut preempted_any = false;

        // 1. Running requests.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let Some(&id) = self.running.get(i) else {
                break;
            };
            let Some(st) = self.reqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let want = st.num_tokens().saturating_sub(st.computed).min(budget);
            if want == 0 {
                i += 1;
                continue;
            }
            let need = self.blocks_needed(st, st.computed + want);
            let mut got = self.pool.allocate(need);
            let mut self_preempted = false;
            while got.is_none() {
                let Some(v) = self.victim() else { break };
                preempted_any = true;
                // Undo anything already scheduled for the victim this step.
                scheduled.retain(|(sid, _)| *sid != v);
                self.preempt(v, &mut events);
                if v == id {
                    self_preempted = true;
                    break;
                }
                got = self.pool.allocate(need);
            }
            if self_preempted {
                continue; // running[i] now holds the next request
            }
            let Some(new_blocks) = got else {
                break;
            };
            if let Some(st) = self.reqs.get_mut(&id) {
                st.blocks.extend(new_blocks);
            }
            scheduled.push((id, want));
            budget -= want;
            // Recompute position: victims removed from the tail never precede i.
            i = self
                .running
                .iter()
                .position(|r| *r == id)
                .map_or(i, |p| p + 1);
        }
        // Budget taken by victims dequeued above is given back.
        let used: u32 = scheduled.iter().map(|(_, n)| *n).sum();
        budget = self.cfg.max_num_batched_tokens.max(1).saturating_sub(used);

        // 2. Waiting requests.
        if !preempted_any {
            while budget > 0 && (self.running.len() as u32) < self.cfg.max_num_seqs {
                let Some((&key, &id)) = self.waiting.iter().next() else {
                    break;
                };
                let Some(st) = self.reqs.get(&id) else {
                    self.waiting.remove(&key);
                    continue;
                };
                let bs = self.cfg.block_size.max(1);
                let num_tokens = st.num_tokens();
                let mut hits = self.pool.lookup(&st.req.block_hashes);
                let max_hit_blocks = (num_tokens.saturating_sub(1) / bs) as usize;
                hits.truncate(max_hit_blocks);
                let hit_tokens = hits.len() as u32 * bs;
                let want = num_tokens.saturating_sub(hit_tokens).min(budget);
                let need = (hit_tokens + want)
                    .div_ceil(bs)
                    .saturating_sub(hits.len() as u32);
                let free_after_touch = self
                    .pool
                    .num_free()
                    .saturating_sub(self.pool.count_free_among(&hits));
                if need > free_after_touch {
                    break;
                }
                self.pool.touch(&hits);
                let Some(new_blocks) = self.pool.allocate(need) else {
                    self.pool.release(&hits);
                    break;
                };
                self.waiting.remove(&key);
                self.counters.prefix_queries_tokens += u64::from(num_tokens);
                self.counters.prefix_hit_tokens += u64::from(hit_tokens);
                if let Some(st) = self.reqs.get_mut(&id) {
                    st.registered = hits.len();
                    st.blocks = hits;
                    st.blocks.extend(new_blocks);
                    st.computed = hit_tokens;
                    st.running = true;
                }
                self.running.push(id);
                events.push(EngineEvent::Admitted {
                    id,
                    time: self.now,
                    cached_tokens: hit_tokens,
                });
                scheduled.push((id, want));
                budget -= want;
            }
        }

        // 3. Step time.
        let mut shape = BatchShape::default();
        for (id, n) in &scheduled {
            let Some(st) = self.reqs.get(id) else {
                continue;
            };
            let n64 = u64::from(*n);
            let k = u64::from(st.computed);
            if *n == 1 && st.computed + 1 == st.num_tokens() && st.generated > 0 {
                shape.decode_seqs += 1;
                shape.decode_context_tokens += k + 1;
            } else {
                shape.prefill_tokens += n64;
                shape.prefill_pairs += n64 * k + n64 * (n64 + 1) / 2;
            }
        }
        let duration = self.cfg.step.step_time(&shape);
        self.now += duration;
        self.counters.steps += 1;
        if shape.prefill_tokens > 0 {
            self.counters.prefill_seconds += duration;
        } else {
            self.counters.decode_seconds += duration;
        }
        self.counters.prompt_tokens += shape.prefill_tokens;

        // 4. Apply.
        let bs = self.cfg.block_size.max(1);
        let mut finished = Vec::new();
        for (id, n) in scheduled {
            let Some(st) = self.reqs.get_mut(&id) else {
                continue;
            };
            st.computed += n;
            // Register newly full prompt blocks.
            let full = (st.computed.min(st.req.prompt_tokens) / bs) as usize;
            let limit = full.min(st.req.block_hashes.len()).min(st.blocks.len());
            while st.registered < limit {
                if let (Some(&b), Some(&h)) = (
                    st.blocks.get(st.registered),
                    st.req.block_hashes.get(st.registered),
                ) {
                    self.pool.register(b, h);
                }
                st.registered += 1;
            }
            if st.computed >= st.num_tokens() {
                st.generated += 1;
                self.counters.generation_tokens += 1;
                let last = st.generated >= st.req.output_tokens;
                events.push(EngineEvent::Token {
                    id,
                    time: self.now,
                    index: st.generated,
                    last,
                });
                if last {
                    finished.push(id);
                }
            }
        }
        for id in finished {
            if let Some(st) = self.reqs.remove(&id) {
                self.pool.release(&st.blocks);
                self.running.retain(|r| *r != id);
                self.counters.finished += 1;
            }
        }
        Some(StepReport {
            duration,
            shape,
            events,
        })
    }
}

/// Progress of one request inside the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestProgress {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens it will generate.
    pub output_tokens: u32,
    /// Tokens whose KV is computed.
    pub computed: u32,
    /// Output tokens produced so far.
    pub generated: u32,
    /// Admitted (holding blocks).
    pub running: bool,
}
