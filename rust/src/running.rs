//! What a coordinator knows about its running requests' block tables, per KV-cache group:
//! how many blocks each request holds, how far its window's blocks are already freed, and
//! the pages it lacks for its decode room. It answers, in one call per request and step,
//! what vLLM's scheduler would otherwise make the managers walk every group for:
//!
//! * [`RunningRequests::decode_step`] (and [`RunningRequests::plan_step`] under it): what
//!   `allocate_slots` for a running request's step would do ([`StepPlan`]): nothing (then
//!   vLLM's answer is the empty `KVCacheBlocks`, and the call can return at once), only
//!   take blocks in full-attention groups and, with prefix caching, Mamba 'align' ones
//!   (then the caller allocates just those), take none but free some in
//!   `remove_skipped_blocks` or cache a filled one in `cache_blocks` (then the caller
//!   runs just those), or anything else (vLLM's rules run);
//! * [`RunningRequests::room_asks`]: how many pages, per pool, do the running requests lack
//!   for `room_tokens` more tokens each? (what an admission must leave them).
//!
//! The block tables themselves stay in vLLM's managers; this table is told about them
//! after every call that can change them ([`RunningRequests::sync`] after an
//! `allocate_slots`, [`RunningRequests::note_removed`] after the window's blocks are
//! freed, [`RunningRequests::forget`] when a request is freed). Every way it can lag
//! behind the managers makes it answer "vLLM's rules", never "quiet" or "grow" wrongly:
//! more blocks than it knows of, or more window blocks freed, only make a step look
//! busier. The one change that would go the other way, a request's blocks shrinking from
//! the end, happens only when the request is freed, which [`RunningRequests::forget`]s it.

use crate::error::PoolError;
use rustc_hash::FxHashMap;

/// What a running request's `allocate_slots` would do, as far as the table can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepPlan {
    /// Nothing: no group allocates, frees or caches a block.
    Quiet,
    /// Only groups that never skip tokens (full attention) and, with prefix caching,
    /// Mamba 'align' groups (one block: the running state moves on) take blocks, this
    /// many per group (0 elsewhere); nothing is freed, cached or checkpointed.
    Grow(Vec<u64>),
    /// No group takes a block and no checkpoint opens, so `get_num_blocks_to_allocate`
    /// and `allocate_new_blocks` find nothing to do; only these phases of vLLM's call
    /// have work (at least one of them).
    Only(Phases),
    /// Anything else (or a request the table does not hold): run vLLM's rules.
    VllmPath,
}

/// The phases of vLLM's `allocate_slots` a decode step that takes no block runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Phases {
    /// `remove_skipped_blocks` frees blocks: a window's, or Mamba 'align' states the
    /// running state has passed.
    pub remove_skipped: bool,
    /// `cache_blocks` caches a block the step fills.
    pub cache: bool,
}

impl Phases {
    fn add(&mut self, other: Phases) {
        self.remove_skipped |= other.remove_skipped;
        self.cache |= other.cache;
    }

    fn any(self) -> bool {
        self.remove_skipped || self.cache
    }
}

/// One KV-cache group's rules, as vLLM's single-type manager applies them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRule {
    /// Tokens per block.
    pub block_size: u64,
    /// Slots the group allocates past the step's own (Mamba's speculative blocks).
    pub extra_slots: u64,
    /// For a group whose blocks leave a window (sliding window, Mamba outside 'align'
    /// mode): vLLM skips `max(0, processed - offset)` tokens. `None`: never skips.
    pub skip_offset: Option<u64>,
    /// For a group whose blocks grow with the sequence and keep decode room: its pool.
    pub room_pool: Option<usize>,
    /// How the group caches blocks (prefix caching).
    pub caching: Caching,
    /// Whether the manager keeps a block for EAGLE's lookup (`manager.use_eagle`): its
    /// cacheable prefix and its prompt's partial entry are counted differently.
    pub use_eagle: bool,
}

/// How a group's manager caches blocks, as far as a decode step can touch them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caching {
    /// Caches nothing (prefix caching off).
    Off,
    /// `FullAttentionManager` with prefix caching: each block is cached once it fills;
    /// where a block holds several hash blocks, every `cache_blocks` also registers the
    /// prompt's last hash boundary inside its block (a partial entry), a no-op once it
    /// is registered while the request holds the block.
    Full,
    /// `MambaManager` in 'align' mode: blocks of `block_size` tokens, the running state
    /// in the last (plus `speculative_blocks`), checkpoints at hash boundaries, and the
    /// state of two steps ago freed once the state moves on.
    MambaAlign { speculative_blocks: u64 },
}

/// The coordinator's `get_num_cacheable_tokens` rule: how many of a step's tokens its
/// `cache_blocks` hands each manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cacheable {
    /// Tokens per hash block (the prefix cache's key granularity).
    pub hash_block_size: u64,
    /// `HybridKVCacheCoordinator`: the prefix is rounded down to this many tokens
    /// (1: not rounded, fine-grained partial hits). `None`: vLLM's base rule.
    pub hybrid_align: Option<u64>,
    /// Trailing tokens never cached (multi-module MTP can prefill them again).
    pub reprefillable: u64,
}

impl Cacheable {
    /// The tokens `cache_blocks` hands the manager of `rule` when it caches `tokens`.
    pub fn tokens(&self, rule: &GroupRule, tokens: u64) -> u64 {
        let finalized = tokens.saturating_sub(self.reprefillable);
        let Some(align) = self.hybrid_align else {
            return finalized;
        };
        let round = |t: u64| t - t % align.max(1);
        let aligned = round(tokens);
        if rule.use_eagle && aligned > 0 {
            finalized.min(round(finalized).saturating_add(rule.block_size))
        } else {
            aligned
        }
    }

    /// The prompt's last hash boundary a full-attention group registers as a partial
    /// entry (0: none, or it ends a block), as `FullAttentionManager` computes it.
    pub fn partial_boundary(&self, rule: &GroupRule, prompt_tokens: u64) -> u64 {
        let hbs = self.hash_block_size.max(1);
        if rule.block_size == hbs {
            return 0;
        }
        let limit = if rule.use_eagle {
            prompt_tokens
        } else {
            prompt_tokens.saturating_sub(1)
        };
        let boundary = limit / hbs * hbs;
        if boundary % rule.block_size == 0 {
            0
        } else {
            boundary
        }
    }
}

/// What the table learns of a caching request's managers after vLLM's `allocate_slots`
/// for it (read from the managers at [`RunningRequests::sync`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheFacts {
    /// Per group: blocks cached so far (`num_cached_block`).
    pub cached: Vec<u64>,
    /// Per group: Mamba 'align' blocks from the start already retired (freed or null).
    pub retired: Vec<u64>,
    /// Per group: the Mamba 'align' state block of two steps ago that a later
    /// `remove_skipped_blocks` frees (`last_state_block_idx`), `None` where there is
    /// none or it is freed already.
    pub stale_state: Vec<Option<u64>>,
    /// Every Mamba 'align' manager has given the request its blocks already and holds
    /// no checkpoint for it (so a quiet step leaves their sets as they are).
    pub settled: bool,
    /// Per group: the prompt's last hash boundary where a Mamba 'align' manager keeps
    /// the state as a partial entry (`get_mamba_prefill_checkpoint_position`); 0 where
    /// there is none, or its block is freed (vLLM skips it), and in other groups.
    pub state_boundary: Vec<u64>,
    /// Tokens the call cached at least (before the coordinator's rule): 0 where it
    /// cached nothing (refused, or its caching delayed for a KV load).
    pub cached_tokens: u64,
    /// The request's prompt length.
    pub prompt_tokens: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    /// Blocks held per group (`None`: the group's manager has no entry for the request).
    held: Vec<Option<u64>>,
    /// Per group: blocks from the table's start that vLLM has certainly freed (nulled).
    removed: Vec<u64>,
    /// A prefix hit vLLM completes at the request's next allocation.
    partial_hit: bool,
    /// Pages lacked for the decode room, per group (0 outside room groups).
    lacks: Vec<u64>,
    /// Per group: blocks cached (caching groups).
    cached: Vec<u64>,
    /// Per group: Mamba 'align' state block a `remove_skipped_blocks` frees later.
    stale_state: Vec<Option<u64>>,
    /// Per group: the prompt's partial entry is registered on a block the request holds.
    partial_done: Vec<bool>,
    /// See [`CacheFacts::state_boundary`].
    state_boundary: Vec<u64>,
    /// See [`CacheFacts::settled`].
    settled: bool,
}

/// A running request's decode step as vLLM's scheduler asks for it
/// (`allocate_slots(request, new_tokens, num_lookahead_tokens=lookahead)`), with the
/// request's counts that `allocate_slots` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeStep {
    pub computed: u64,
    pub new_tokens: u64,
    pub lookahead: u64,
    /// Tokens of the last step not processed yet (async scheduling).
    pub in_flight: u64,
    pub prompt_tokens: u64,
    pub num_tokens: u64,
    pub max_model_len: u64,
}

impl DecodeStep {
    /// vLLM's `num_tokens_need_slot`: the slots the request holds after the step.
    pub fn slots(&self) -> u64 {
        let computed = self.computed.min(self.max_model_len);
        computed
            .saturating_add(self.new_tokens)
            .saturating_add(self.lookahead)
            .min(self.max_model_len)
    }

    /// vLLM's `num_tokens_main_model`: the step's tokens without lookahead slots.
    pub fn main(&self) -> u64 {
        self.computed
            .min(self.max_model_len)
            .saturating_add(self.new_tokens)
    }

    /// The tokens `allocate_slots` asks the coordinator to cache (before its rule): the
    /// step's, capped at the request's own (draft tokens are not cached).
    pub fn cache_tokens(&self) -> u64 {
        self.main().min(self.num_tokens)
    }

    /// The processed prefix `allocate_slots` gives `remove_skipped_blocks`.
    pub fn processed(&self) -> u64 {
        self.computed
            .min(self.max_model_len)
            .saturating_sub(self.in_flight)
    }

    /// The length the request's decode room is counted from: after this step, or its
    /// prompt's if longer (a prefill in chunks needs all of it; a resumed request replays
    /// its output as prompt).
    pub fn room_length(&self) -> u64 {
        self.prompt_tokens
            .max(self.num_tokens.saturating_sub(1))
            .max(self.computed.saturating_add(self.new_tokens))
    }
}

/// Recount `entry`'s room at `length` tokens into `totals`: per room group, the pages past
/// those it holds that `length + room_tokens` tokens need.
fn recount(
    rules: &[GroupRule],
    room_tokens: u64,
    totals: &mut [u64],
    entry: &mut Entry,
    length: u64,
) {
    let end = length.saturating_add(room_tokens);
    for (g, rule) in rules.iter().enumerate() {
        let lack = match (rule.room_pool, entry.held[g]) {
            (Some(_), Some(held)) if room_tokens > 0 => {
                end.div_ceil(rule.block_size).saturating_sub(held)
            }
            _ => 0,
        };
        totals[g] = totals[g] - entry.lacks[g] + lack;
        entry.lacks[g] = lack;
    }
}

/// What `allocate_slots` for the request of `entry` would do, giving it `slots` token
/// slots in all with `processed` tokens safely computed (see [`StepPlan`]). Caching
/// groups need the whole `step` (without it: vLLM's rules).
fn plan_entry(
    rules: &[GroupRule],
    cacheable: Option<&Cacheable>,
    entry: &Entry,
    slots: u64,
    processed: u64,
    step: Option<&DecodeStep>,
) -> StepPlan {
    if entry.partial_hit {
        return StepPlan::VllmPath;
    }
    let mut needs = Vec::new();
    let mut phases = Phases::default();
    for (g, rule) in rules.iter().enumerate() {
        let Some(held) = entry.held[g] else {
            return StepPlan::VllmPath;
        };
        if rule.caching != Caching::Off {
            // No checkpoint in a caching group, and at most blocks taken, blocks freed by
            // `remove_skipped_blocks` and a filled block cached; anything else takes
            // vLLM's path.
            let part = match (cacheable, step) {
                (Some(c), Some(step)) => caching_group_step(rule, c, entry, g, held, step),
                _ => None,
            };
            let Some((part, need)) = part else {
                return StepPlan::VllmPath;
            };
            phases.add(part);
            if need > 0 {
                if needs.is_empty() {
                    needs = vec![0; rules.len()];
                }
                needs[g] = need;
            }
            continue;
        }
        // Blocks past those held: vLLM's `get_num_blocks_to_allocate`.
        let need = slots
            .saturating_add(rule.extra_slots)
            .div_ceil(rule.block_size)
            .saturating_sub(held);
        if let Some(offset) = rule.skip_offset {
            // `remove_skipped_blocks` frees back from its last skipped block and
            // stops at a freed one: nothing to do if that block is freed already.
            let last = (processed.saturating_sub(offset) / rule.block_size).min(held);
            if need > 0 {
                // A windowed group grows: vLLM's rules.
                return StepPlan::VllmPath;
            }
            // The window moves: `remove_skipped_blocks` frees its blocks.
            phases.remove_skipped |= last > entry.removed[g];
        }
        if need > 0 {
            if cacheable.is_some() {
                // A group that caches nothing beside caching ones: vLLM's rules.
                return StepPlan::VllmPath;
            }
            if needs.is_empty() {
                needs = vec![0; rules.len()];
            }
            needs[g] = need;
        }
    }
    match (needs.is_empty(), phases.any()) {
        (true, false) => StepPlan::Quiet,
        (true, true) => StepPlan::Only(phases),
        (false, false) => StepPlan::Grow(needs),
        // Growth beside removal or caching in one step: vLLM's rules.
        (false, true) => StepPlan::VllmPath,
    }
}

/// What vLLM's `allocate_slots` for a decode `step` does to caching group `g` (which
/// holds `held` blocks): the phases other than allocation that have work there, and the
/// blocks it takes (none of either: the group is quiet). `None` where anything else
/// happens (a checkpoint opens, a partial entry is registered, Mamba 'align' takes more
/// than one block). Only decode steps (the prompt computed) of settled requests qualify.
fn caching_group_step(
    rule: &GroupRule,
    cacheable: &Cacheable,
    entry: &Entry,
    g: usize,
    held: u64,
    step: &DecodeStep,
) -> Option<(Phases, u64)> {
    let computed = step.computed.min(step.max_model_len);
    if !entry.settled || computed == 0 || step.computed < step.prompt_tokens {
        return None;
    }
    let size = rule.block_size;
    let cached_tokens = cacheable.tokens(rule, step.cache_tokens());
    // `cache_blocks` returns at once while no new block is full.
    let fills = cached_tokens / size > entry.cached[g];
    let cache_only = Phases {
        remove_skipped: false,
        cache: fills,
    };
    match rule.caching {
        Caching::Off => Some((Phases::default(), 0)),
        Caching::Full => {
            let boundary = cacheable.partial_boundary(rule, step.prompt_tokens);
            // No partial entry, or one registered already (re-registering the same key
            // on the same block is a no-op), or one `cache_blocks` does not reach yet.
            let partial_quiet = boundary == 0
                || entry.partial_done[g]
                || boundary > cached_tokens
                || boundary / size >= held;
            let need = step.slots().div_ceil(size).saturating_sub(held);
            partial_quiet.then_some((cache_only, need))
        }
        Caching::MambaAlign { speculative_blocks } => {
            let main = step.main();
            // 'align' blocks count the step's own tokens, not lookahead slots. The running
            // state moves into one new block (more: vLLM caps what it counts).
            let need = main
                .div_ceil(size)
                .saturating_add(speculative_blocks)
                .saturating_sub(held);
            if need > 1 {
                return None;
            }
            // A checkpoint column past the initial state's: vLLM may reserve one.
            if main.div_ceil(size) >= (computed - 1) / size + 3 {
                return None;
            }
            // A state at the prompt's last hash boundary is registered (a partial
            // entry).
            if cached_tokens != 0
                && cached_tokens == entry.state_boundary[g]
                && cached_tokens % cacheable.hash_block_size.max(1) == 0
            {
                return None;
            }
            let processed = step.processed();
            // Blocks before the running state's retire (vLLM's window for 'align').
            let retires = processed >= 2 && ((processed - 1) / size).min(held) > entry.removed[g];
            // The state of two steps ago is freed once the state passes it.
            let stale_freed = entry.stale_state[g]
                .is_some_and(|stale| stale.saturating_add(1) < processed.div_ceil(size));
            Some((
                Phases {
                    remove_skipped: retires || stale_freed,
                    cache: fills,
                },
                need,
            ))
        }
    }
}

/// The running requests of one coordinator (see the module's documentation).
#[derive(Debug, Clone)]
pub struct RunningRequests {
    rules: Vec<GroupRule>,
    /// The coordinator's caching rule where a group caches blocks.
    cacheable: Option<Cacheable>,
    quiet_steps: bool,
    room_tokens: u64,
    entries: FxHashMap<String, Entry>,
    /// Per group: the pages all requests lack for their room.
    room_totals: Vec<u64>,
}

impl RunningRequests {
    /// A table for groups with these rules. `quiet_steps`: whether [`Self::quiet_step`]
    /// may answer "quiet" at all (the coordinator's managers' rules are all modelled);
    /// `room_tokens`: each running request's decode room (0: none kept); `cacheable`:
    /// the coordinator's caching rule, required where a group caches blocks.
    pub fn new(
        rules: Vec<GroupRule>,
        quiet_steps: bool,
        room_tokens: u64,
        cacheable: Option<Cacheable>,
    ) -> Result<Self, PoolError> {
        if let Some((g, _)) = rules.iter().enumerate().find(|(_, r)| r.block_size == 0) {
            return Err(PoolError::InvalidArgument(format!(
                "group {g}: block size 0"
            )));
        }
        let caches = rules.iter().any(|r| r.caching != Caching::Off);
        match cacheable {
            None if caches => {
                return Err(PoolError::InvalidArgument(
                    "caching groups need the coordinator's caching rule".to_owned(),
                ))
            }
            Some(c) if c.hash_block_size == 0 || c.hybrid_align == Some(0) => {
                return Err(PoolError::InvalidArgument(format!(
                    "hash block size {} / alignment {:?}: must be positive",
                    c.hash_block_size, c.hybrid_align
                )))
            }
            _ => {}
        }
        let n = rules.len();
        Ok(Self {
            rules,
            cacheable: cacheable.filter(|_| caches),
            quiet_steps,
            room_tokens,
            entries: FxHashMap::default(),
            room_totals: vec![0; n],
        })
    }

    /// What the coordinator's caching rule hands group `group` of `tokens` (`None`: the
    /// table caches nothing).
    pub fn cacheable_tokens(&self, group: usize, tokens: u64) -> Result<Option<u64>, PoolError> {
        let rule = self.rules.get(group).ok_or_else(|| {
            PoolError::InvalidArgument(format!("group {group} of {}", self.rules.len()))
        })?;
        Ok(self.cacheable.as_ref().map(|c| c.tokens(rule, tokens)))
    }

    /// Whether [`Self::quiet_step`] may answer "quiet" at all.
    pub fn quiet_steps(&self) -> bool {
        self.quiet_steps
    }

    pub fn contains(&self, request_id: &str) -> bool {
        self.entries.contains_key(request_id)
    }

    pub fn num_groups(&self) -> usize {
        self.rules.len()
    }

    /// Requests the table holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn check_groups(&self, request_id: &str, given: usize, what: &str) -> Result<(), PoolError> {
        if given != self.rules.len() {
            return Err(PoolError::InvalidArgument(format!(
                "request {request_id}: {given} {what} for {} groups",
                self.rules.len()
            )));
        }
        Ok(())
    }

    /// After vLLM's `allocate_slots` for `request_id`: the blocks each group holds now
    /// (`None` where the group's manager has no entry), whether a prefix hit is pending,
    /// the request's length for its room, and (caching groups) what the managers hold
    /// of it (without `facts` its steps take vLLM's path until a sync brings them). A
    /// request no group holds blocks for is not running (refused, or not admitted yet)
    /// and is forgotten.
    pub fn sync(
        &mut self,
        request_id: &str,
        held: &[Option<u64>],
        partial_hit: bool,
        room_length: u64,
        facts: Option<&CacheFacts>,
    ) -> Result<(), PoolError> {
        self.check_groups(request_id, held.len(), "block counts")?;
        if let Some(f) = facts {
            self.check_groups(request_id, f.cached.len(), "cached block counts")?;
            self.check_groups(request_id, f.retired.len(), "retired block counts")?;
            self.check_groups(request_id, f.stale_state.len(), "stale state blocks")?;
            self.check_groups(request_id, f.state_boundary.len(), "state boundaries")?;
        }
        if held.iter().all(Option::is_none) {
            self.forget(request_id);
            return Ok(());
        }
        let n = self.rules.len();
        let mut entry = self.entries.remove(request_id).unwrap_or_else(|| Entry {
            held: vec![None; n],
            removed: vec![0; n],
            partial_hit: false,
            lacks: vec![0; n],
            cached: vec![0; n],
            stale_state: vec![None; n],
            partial_done: vec![false; n],
            state_boundary: vec![0; n],
            settled: false,
        });
        entry.held.copy_from_slice(held);
        entry.partial_hit = partial_hit;
        entry.settled = false;
        if let (Some(c), Some(f)) = (self.cacheable.as_ref(), facts) {
            entry.settled = f.settled;
            entry.cached.copy_from_slice(&f.cached);
            entry.stale_state.copy_from_slice(&f.stale_state);
            entry.state_boundary.copy_from_slice(&f.state_boundary);
            for (g, rule) in self.rules.iter().enumerate() {
                match rule.caching {
                    Caching::MambaAlign { .. } => entry.removed[g] = f.retired[g],
                    Caching::Full => {
                        // The call registered the prompt's partial entry if its
                        // `cache_blocks` reached the boundary and the block existed.
                        let boundary = c.partial_boundary(rule, f.prompt_tokens);
                        let reached = boundary > 0
                            && boundary <= c.tokens(rule, f.cached_tokens)
                            && held[g].is_some_and(|h| boundary / rule.block_size < h);
                        entry.partial_done[g] |= reached;
                    }
                    Caching::Off => {}
                }
            }
        }
        recount(
            &self.rules,
            self.room_tokens,
            &mut self.room_totals,
            &mut entry,
            room_length,
        );
        self.entries.insert(request_id.to_owned(), entry);
        Ok(())
    }

    /// After a decode step that [`Self::decode_step`] answered with growth took exactly
    /// `needs[g]` more blocks in each group: what [`Self::sync`] with the managers' new
    /// counts would record (no facts: the table caches nothing), without walking them;
    /// the room is recounted at `room_length`. Refused, the table unchanged, for a
    /// request it does not hold or a group given blocks that holds none.
    pub fn grown(
        &mut self,
        request_id: &str,
        needs: &[u64],
        room_length: u64,
    ) -> Result<(), PoolError> {
        self.check_groups(request_id, needs.len(), "block counts")?;
        let Some(entry) = self.entries.get_mut(request_id) else {
            return Err(PoolError::InvalidArgument(format!(
                "request {request_id} is not in the running requests' table"
            )));
        };
        if let Some(g) = (0..needs.len()).find(|&g| needs[g] > 0 && entry.held[g].is_none()) {
            return Err(PoolError::InvalidArgument(format!(
                "request {request_id}: group {g} holds no blocks to grow"
            )));
        }
        for (held, &n) in entry.held.iter_mut().zip(needs) {
            if let Some(h) = held {
                *h += n;
            }
        }
        entry.settled = false;
        recount(
            &self.rules,
            self.room_tokens,
            &mut self.room_totals,
            entry,
            room_length,
        );
        Ok(())
    }

    /// After vLLM's `remove_skipped_blocks(request_id, processed)`, with the blocks each
    /// group held then: every block before `min(skipped // block_size, held)` is freed
    /// (caching groups: the request is no longer settled).
    /// A request the table does not hold yet is left to its next [`Self::sync`] (which
    /// then knows of no freed block: its steps look busier until vLLM's path runs again).
    pub fn note_removed(
        &mut self,
        request_id: &str,
        processed: u64,
        held: &[Option<u64>],
    ) -> Result<(), PoolError> {
        self.check_groups(request_id, held.len(), "block counts")?;
        let Some(entry) = self.entries.get_mut(request_id) else {
            return Ok(());
        };
        // What caching managers changed besides is learnt at the next sync; until then
        // the request's steps take vLLM's path.
        entry.settled = false;
        for (g, rule) in self.rules.iter().enumerate() {
            let (Some(offset), Some(held)) = (rule.skip_offset, held[g]) else {
                continue;
            };
            let skipped = processed.saturating_sub(offset);
            let last = (skipped / rule.block_size).min(held);
            entry.removed[g] = entry.removed[g].max(last);
        }
        Ok(())
    }

    /// What `allocate_slots` for running request `request_id`, giving it `slots` token
    /// slots in all with `processed` tokens safely computed, would do (see [`StepPlan`]).
    /// Reads the table only. Caching groups need [`Self::decode_step`].
    pub fn plan_step(&self, request_id: &str, slots: u64, processed: u64) -> StepPlan {
        match self.entries.get(request_id) {
            Some(entry) if self.quiet_steps => plan_entry(
                &self.rules,
                self.cacheable.as_ref(),
                entry,
                slots,
                processed,
                None,
            ),
            _ => StepPlan::VllmPath,
        }
    }

    /// [`Self::plan_step`], recounting a quiet step's room at `room_length` (the step's
    /// own bookkeeping; a step that grows is told with [`Self::sync`] once its blocks are
    /// allocated). One lookup of the request: this is the scheduler's hot path.
    fn step(
        &mut self,
        request_id: &str,
        slots: u64,
        processed: u64,
        room_length: u64,
        step: Option<&DecodeStep>,
    ) -> StepPlan {
        if !self.quiet_steps {
            return StepPlan::VllmPath;
        }
        let Some(entry) = self.entries.get_mut(request_id) else {
            return StepPlan::VllmPath;
        };
        let plan = plan_entry(
            &self.rules,
            self.cacheable.as_ref(),
            entry,
            slots,
            processed,
            step,
        );
        if plan == StepPlan::Quiet && self.room_tokens > 0 {
            recount(
                &self.rules,
                self.room_tokens,
                &mut self.room_totals,
                entry,
                room_length,
            );
        }
        plan
    }

    /// Whether the step ([`Self::plan_step`]) is quiet; if so the request's room is
    /// recounted at `room_length`. Caching groups need [`Self::decode_step`].
    pub fn quiet_step(
        &mut self,
        request_id: &str,
        slots: u64,
        processed: u64,
        room_length: u64,
    ) -> bool {
        self.step(request_id, slots, processed, room_length, None) == StepPlan::Quiet
    }

    /// [`Self::plan_step`] for a decode step given as vLLM's scheduler asks for it; a
    /// quiet step's room is recounted.
    pub fn decode_step(&mut self, request_id: &str, step: &DecodeStep) -> StepPlan {
        self.step(
            request_id,
            step.slots(),
            step.processed(),
            step.room_length(),
            Some(step),
        )
    }

    /// Cached blocks were evicted from the prefix cache (vLLM's `evict_blocks`, after a
    /// failed KV load): a partial entry registered for a running request may be gone,
    /// and vLLM's `cache_blocks` registers it again at that request's next step. Every
    /// request's next step therefore takes vLLM's path (its `sync` brings the facts
    /// back). Block counts and room are unchanged.
    pub fn cache_evicted(&mut self) {
        for entry in self.entries.values_mut() {
            entry.settled = false;
            entry.partial_done.fill(false);
        }
    }

    /// The request is freed (or its blocks popped for a deferred free): its room is no
    /// longer kept. Unknown requests are ignored (vLLM frees requests it never allocated
    /// for, e.g. one aborted while waiting).
    pub fn forget(&mut self, request_id: &str) {
        if let Some(entry) = self.entries.remove(request_id) {
            for (total, lack) in self.room_totals.iter_mut().zip(&entry.lacks) {
                *total -= lack;
            }
        }
    }

    /// (pool, pages) per room group with pages lacked, in group order: what the running
    /// requests other than `except` lack for their decode room.
    pub fn room_asks(&self, except: &str) -> Vec<(usize, u64)> {
        let own = self.entries.get(except).map(|e| &e.lacks);
        self.rules
            .iter()
            .enumerate()
            .filter_map(|(g, rule)| {
                let pool = rule.room_pool?;
                let pages = self.room_totals[g] - own.map_or(0, |l| l[g]);
                (pages > 0).then_some((pool, pages))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REMOVE: Phases = Phases {
        remove_skipped: true,
        cache: false,
    };
    const CACHE: Phases = Phases {
        remove_skipped: false,
        cache: true,
    };

    fn full(size: u64, pool: usize) -> GroupRule {
        GroupRule {
            block_size: size,
            extra_slots: 0,
            skip_offset: None,
            room_pool: Some(pool),
            caching: Caching::Off,
            use_eagle: false,
        }
    }

    fn window(size: u64, offset: u64) -> GroupRule {
        GroupRule {
            block_size: size,
            extra_slots: 0,
            skip_offset: Some(offset),
            room_pool: None,
            caching: Caching::Off,
            use_eagle: false,
        }
    }

    #[test]
    fn a_step_inside_held_blocks_is_quiet_and_one_past_them_is_not() {
        let mut t = RunningRequests::new(vec![full(16, 0)], true, 0, None).unwrap();
        assert!(
            !t.quiet_step("a", 10, 9, 0),
            "unknown requests are never quiet"
        );
        t.sync("a", &[Some(2)], false, 0, None).unwrap();
        assert!(t.quiet_step("a", 32, 31, 0));
        assert!(!t.quiet_step("a", 33, 32, 0));
        t.sync("a", &[Some(2)], true, 0, None).unwrap();
        assert!(
            !t.quiet_step("a", 20, 19, 0),
            "a pending prefix hit is never quiet"
        );
        t.forget("a");
        assert!(!t.quiet_step("a", 20, 19, 0));
    }

    #[test]
    fn grown_records_what_a_sync_of_the_new_counts_would() {
        let rules = || vec![full(16, 0), full(32, 1), window(16, 31)];
        let mut synced = RunningRequests::new(rules(), true, 64, None).unwrap();
        let mut grown = RunningRequests::new(rules(), true, 64, None).unwrap();
        for t in [&mut synced, &mut grown] {
            t.sync("a", &[Some(3), Some(2), Some(4)], false, 40, None)
                .unwrap();
            t.sync("b", &[Some(1), Some(1), Some(1)], false, 10, None)
                .unwrap();
        }
        synced
            .sync("a", &[Some(4), Some(3), Some(4)], false, 49, None)
            .unwrap();
        grown.grown("a", &[1, 1, 0], 49).unwrap();
        assert_eq!(synced.room_asks(""), grown.room_asks(""));
        assert_eq!(synced.room_asks("b"), grown.room_asks("b"));
        for slots in [60, 64, 65, 96, 97] {
            assert_eq!(
                synced.plan_step("a", slots, slots - 1),
                grown.plan_step("a", slots, slots - 1)
            );
        }
        // Refused, nothing changed: an unknown request, a group without blocks, a count
        // for the wrong number of groups.
        let before = grown.room_asks("");
        assert!(grown.grown("zz", &[1, 0, 0], 60).is_err());
        assert!(grown.grown("a", &[1, 0], 60).is_err());
        grown
            .sync("c", &[Some(1), None, None], false, 5, None)
            .unwrap();
        let with_c = grown.room_asks("");
        assert!(grown.grown("c", &[1, 1, 0], 60).is_err());
        assert_eq!(grown.room_asks(""), with_c);
        grown.forget("c");
        assert_eq!(grown.room_asks(""), before);
    }

    #[test]
    fn window_steps_are_quiet_only_until_a_block_leaves_the_window() {
        // Sliding window of 32 tokens: skipped = processed - 31.
        let mut t = RunningRequests::new(vec![window(16, 31)], true, 0, None).unwrap();
        t.sync("a", &[Some(8)], false, 0, None).unwrap();
        // processed 46: 15 skipped, no block leaves.
        assert!(t.quiet_step("a", 100, 46, 0));
        // processed 47: 16 skipped, block 0 leaves, and vLLM has not freed it yet.
        assert!(!t.quiet_step("a", 100, 47, 0));
        t.note_removed("a", 47, &[Some(8)]).unwrap();
        assert!(t.quiet_step("a", 100, 62, 0));
        assert!(!t.quiet_step("a", 100, 63, 0));
        // Freed blocks are capped at those held when vLLM freed them.
        t.note_removed("a", 1000, &[Some(3)]).unwrap();
        t.sync("a", &[Some(8)], false, 0, None).unwrap();
        assert!(t.quiet_step("a", 100, 31 + 16 * 3, 0));
        assert!(!t.quiet_step("a", 100, 31 + 16 * 4, 0));
    }

    #[test]
    fn room_totals_follow_each_request() {
        // Full attention (pool 3) and a Mamba-like state: one block, skipped = processed - 1.
        let mut t =
            RunningRequests::new(vec![full(16, 3), window(4096, 1)], true, 40, None).unwrap();
        t.sync("a", &[Some(2), Some(1)], false, 20, None).unwrap(); // needs ceil(60/16)=4: lacks 2
        t.sync("b", &[Some(1), Some(1)], false, 10, None).unwrap(); // ceil(50/16)=4: lacks 3
        assert_eq!(t.room_asks(""), vec![(3, 5)]);
        assert_eq!(t.room_asks("a"), vec![(3, 3)]);
        assert!(t.quiet_step("a", 24, 23, 30)); // ceil(70/16)=5: lacks 3
        assert_eq!(t.room_asks("b"), vec![(3, 3)]);
        t.sync("b", &[None, None], false, 10, None).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t.room_asks(""), vec![(3, 3)]);
        t.forget("a");
        t.forget("a");
        assert!(t.is_empty());
        assert_eq!(t.room_asks(""), vec![]);
    }

    #[test]
    fn without_quiet_steps_only_the_room_is_kept() {
        let mut t = RunningRequests::new(vec![full(16, 0)], false, 16, None).unwrap();
        t.sync("a", &[Some(4)], false, 16, None).unwrap();
        assert!(!t.quiet_step("a", 17, 16, 16));
        assert_eq!(t.room_asks(""), vec![]);
        t.sync("a", &[Some(1)], false, 16, None).unwrap();
        assert_eq!(t.room_asks(""), vec![(0, 1)]);
    }

    #[test]
    fn a_decode_step_counts_as_allocate_slots_does() {
        let step = DecodeStep {
            computed: 100,
            new_tokens: 1,
            lookahead: 2,
            in_flight: 1,
            prompt_tokens: 90,
            num_tokens: 101,
            max_model_len: 102,
        };
        assert_eq!(step.slots(), 102, "capped at max_model_len");
        assert_eq!(step.processed(), 99);
        assert_eq!(step.room_length(), 101);
        let resumed = DecodeStep {
            prompt_tokens: 300,
            ..step
        };
        assert_eq!(resumed.room_length(), 300);
        let mut t = RunningRequests::new(vec![full(16, 0)], true, 16, None).unwrap();
        t.sync("a", &[Some(7)], false, 100, None).unwrap();
        assert_eq!(t.decode_step("a", &step), StepPlan::Quiet);
        assert_eq!(
            t.room_asks(""),
            vec![(0, 1)],
            "ceil((101 + 16) / 16) = 8 pages"
        );
    }

    #[test]
    fn a_step_past_held_blocks_grows_only_groups_without_a_window() {
        let mut t = RunningRequests::new(
            vec![full(16, 0), window(4096, 1), full(32, 1)],
            true,
            0,
            None,
        )
        .unwrap();
        t.sync("a", &[Some(2), Some(1), Some(1)], false, 0, None)
            .unwrap();
        assert_eq!(t.plan_step("a", 32, 31), StepPlan::Quiet);
        assert_eq!(t.plan_step("a", 33, 32), StepPlan::Grow(vec![1, 0, 1]));
        assert_eq!(t.plan_step("a", 50, 49), StepPlan::Grow(vec![2, 0, 1]));
        // The state group would need a second block: vLLM's rules.
        assert_eq!(t.plan_step("a", 4097, 4096), StepPlan::VllmPath);
        // Its window moves (processed 4097: one state block skipped): only removal.
        t.sync("a", &[Some(300), Some(1), Some(200)], false, 0, None)
            .unwrap();
        assert_eq!(t.plan_step("a", 4096, 4097), StepPlan::Only(REMOVE));
        // The window moves while the full-attention groups grow: vLLM's rules.
        t.sync("a", &[Some(250), Some(1), Some(100)], false, 0, None)
            .unwrap();
        assert_eq!(t.plan_step("a", 4096, 4097), StepPlan::VllmPath);
        t.sync("a", &[Some(300), Some(1), Some(200)], false, 0, None)
            .unwrap();
        t.note_removed("a", 4097, &[Some(300), Some(1), Some(200)])
            .unwrap();
        assert_eq!(t.plan_step("a", 4096, 4097), StepPlan::Quiet);
        assert_eq!(t.plan_step("b", 1, 0), StepPlan::VllmPath);
        let off = RunningRequests::new(vec![full(16, 0)], false, 0, None).unwrap();
        assert_eq!(off.plan_step("a", 1, 0), StepPlan::VllmPath);
    }

    fn caching(size: u64, caching: Caching) -> GroupRule {
        GroupRule {
            block_size: size,
            extra_slots: 0,
            skip_offset: None,
            room_pool: None,
            caching,
            use_eagle: false,
        }
    }

    const CACHEABLE: Cacheable = Cacheable {
        hash_block_size: 16,
        hybrid_align: Some(1),
        reprefillable: 0,
    };

    fn decode(computed: u64, prompt_tokens: u64) -> DecodeStep {
        DecodeStep {
            computed,
            new_tokens: 1,
            lookahead: 0,
            in_flight: 0,
            prompt_tokens,
            num_tokens: computed + 1,
            max_model_len: 4096,
        }
    }

    fn facts(cached: u64, retired: u64, stale: Option<u64>, cached_tokens: u64) -> CacheFacts {
        CacheFacts {
            cached: vec![cached],
            retired: vec![retired],
            stale_state: vec![stale],
            // Prompt 100: its state is kept at 96 tokens.
            state_boundary: vec![96],
            settled: true,
            cached_tokens,
            prompt_tokens: 100,
        }
    }

    #[test]
    fn an_eviction_sends_every_next_step_down_vllms_path() {
        let rule = caching(64, Caching::Full);
        let mut t = RunningRequests::new(vec![rule], true, 0, Some(CACHEABLE)).unwrap();
        for id in ["a", "b"] {
            t.sync(id, &[Some(2)], false, 0, Some(&facts(1, 0, None, 101)))
                .unwrap();
            assert_eq!(t.decode_step(id, &decode(101, 100)), StepPlan::Quiet);
        }
        // The partial entry at 96 tokens may have been evicted: vLLM's `cache_blocks`
        // registers it again, so the step is vLLM's.
        t.cache_evicted();
        for id in ["a", "b"] {
            assert_eq!(t.decode_step(id, &decode(102, 100)), StepPlan::VllmPath);
        }
        assert_eq!(t.len(), 2, "the requests stay in the table");
        // After vLLM's step, the sync's facts make the next steps quiet again.
        t.sync("a", &[Some(2)], false, 0, Some(&facts(1, 0, None, 102)))
            .unwrap();
        assert_eq!(t.decode_step("a", &decode(102, 100)), StepPlan::Quiet);
        assert_eq!(t.decode_step("b", &decode(102, 100)), StepPlan::VllmPath);
    }

    #[test]
    fn caching_full_attention_is_quiet_until_a_block_fills() {
        let rule = caching(64, Caching::Full);
        assert!(RunningRequests::new(vec![rule.clone()], true, 0, None).is_err());
        let mut t = RunningRequests::new(vec![rule], true, 0, Some(CACHEABLE)).unwrap();
        // Prompt 100: its partial entry is at 96 tokens, inside block 1.
        assert_eq!(CACHEABLE.partial_boundary(&t.rules[0], 100), 96);
        t.sync("a", &[Some(2)], false, 0, Some(&facts(1, 0, None, 90)))
            .unwrap();
        assert_eq!(
            t.decode_step("a", &decode(101, 100)),
            StepPlan::VllmPath,
            "the partial entry is not registered yet"
        );
        t.sync("a", &[Some(2)], false, 0, Some(&facts(1, 0, None, 101)))
            .unwrap();
        assert_eq!(t.decode_step("a", &decode(101, 100)), StepPlan::Quiet);
        assert_eq!(t.decode_step("a", &decode(126, 100)), StepPlan::Quiet);
        assert_eq!(
            t.decode_step("a", &decode(127, 100)),
            StepPlan::Only(CACHE),
            "block 1 fills: only vLLM's cache_blocks has work"
        );
        let mut drafts = decode(127, 100);
        drafts.lookahead = 2;
        assert_eq!(
            t.decode_step("a", &drafts),
            StepPlan::VllmPath,
            "block 1 fills while lookahead slots take block 2"
        );
        assert_eq!(
            t.decode_step("a", &decode(90, 100)),
            StepPlan::VllmPath,
            "a prefill chunk"
        );
        // 129 tokens: block 2 starts, nothing fills.
        t.sync("a", &[Some(2)], false, 0, Some(&facts(2, 0, None, 128)))
            .unwrap();
        assert_eq!(
            t.decode_step("a", &decode(128, 100)),
            StepPlan::Grow(vec![1])
        );
        // A block fills as the next starts: vLLM's rules.
        t.sync("a", &[Some(2)], false, 0, Some(&facts(1, 0, None, 127)))
            .unwrap();
        let mut drafts = decode(127, 100);
        drafts.lookahead = 2;
        assert_eq!(t.decode_step("a", &drafts), StepPlan::VllmPath);
        // Without facts (or unsettled), never quiet.
        t.sync("a", &[Some(3)], false, 0, None).unwrap();
        assert_eq!(t.decode_step("a", &decode(130, 100)), StepPlan::VllmPath);
        let mut unsettled = facts(2, 0, None, 130);
        unsettled.settled = false;
        t.sync("a", &[Some(3)], false, 0, Some(&unsettled)).unwrap();
        assert_eq!(t.decode_step("a", &decode(130, 100)), StepPlan::VllmPath);
        t.sync("a", &[Some(3)], false, 0, Some(&facts(2, 0, None, 130)))
            .unwrap();
        assert_eq!(t.decode_step("a", &decode(130, 100)), StepPlan::Quiet);
        assert_eq!(
            t.plan_step("a", 131, 130),
            StepPlan::VllmPath,
            "caching groups need the whole step"
        );
    }

    #[test]
    fn align_state_steps_are_quiet_between_blocks_and_hash_boundaries() {
        let rule = caching(
            64,
            Caching::MambaAlign {
                speculative_blocks: 0,
            },
        );
        let mut t = RunningRequests::new(vec![rule], true, 0, Some(CACHEABLE)).unwrap();
        // Three blocks, the state in block 2; block 1 (two steps ago) not freed yet.
        t.sync("a", &[Some(3)], false, 0, Some(&facts(2, 1, Some(1), 150)))
            .unwrap();
        assert_eq!(
            t.decode_step("a", &decode(150, 100)),
            StepPlan::Only(REMOVE),
            "the stale state is freed, and block 1 retired: only removal"
        );
        // Block 1 below the retired ones but not freed (vLLM frees the state of two steps
        // ago by its index, whatever the retired count says).
        t.sync("a", &[Some(3)], false, 0, Some(&facts(2, 2, Some(1), 151)))
            .unwrap();
        assert_eq!(
            t.decode_step("a", &decode(150, 100)),
            StepPlan::Only(REMOVE)
        );
        // A removal in a step that also takes a block: vLLM's rules.
        assert_eq!(t.decode_step("a", &decode(192, 100)), StepPlan::VllmPath);
        // Not settled (the managers' facts unknown since a removal): vLLM's rules.
        t.note_removed("a", 150, &[Some(3)]).unwrap();
        assert_eq!(t.decode_step("a", &decode(150, 100)), StepPlan::VllmPath);
        t.sync("a", &[Some(3)], false, 0, Some(&facts(2, 2, None, 151)))
            .unwrap();
        assert_eq!(t.decode_step("a", &decode(150, 100)), StepPlan::Quiet);
        assert_eq!(
            t.decode_step("a", &decode(159, 100)),
            StepPlan::Quiet,
            "160 tokens: a hash boundary past the prompt's"
        );
        let mut boundary = facts(2, 2, None, 151);
        boundary.state_boundary = vec![160];
        t.sync("a", &[Some(3)], false, 0, Some(&boundary)).unwrap();
        assert_eq!(
            t.decode_step("a", &decode(159, 100)),
            StepPlan::VllmPath,
            "the prompt's state boundary: vLLM keeps the state there"
        );
        t.sync("a", &[Some(3)], false, 0, Some(&facts(2, 2, None, 151)))
            .unwrap();
        assert_eq!(t.decode_step("a", &decode(190, 100)), StepPlan::Quiet);
        assert_eq!(
            t.decode_step("a", &decode(191, 100)),
            StepPlan::Only(CACHE),
            "192: block 2 fills, and only vLLM's cache_blocks has work"
        );
        assert_eq!(
            t.decode_step("a", &decode(192, 100)),
            StepPlan::VllmPath,
            "193 tokens with block 2 not cached yet: it fills as block 3 starts"
        );
        t.sync("a", &[Some(3)], false, 0, Some(&facts(3, 2, None, 192)))
            .unwrap();
        assert_eq!(
            t.decode_step("a", &decode(192, 100)),
            StepPlan::Grow(vec![1]),
            "193: the state moves into block 3"
        );
        let mut two = decode(192, 100);
        two.new_tokens = 65;
        assert_eq!(
            t.decode_step("a", &two),
            StepPlan::VllmPath,
            "two blocks: vLLM caps what it counts"
        );
        let mut drafts = decode(150, 100);
        drafts.lookahead = 40;
        assert_eq!(
            t.decode_step("a", &drafts),
            StepPlan::Quiet,
            "lookahead slots take no 'align' block"
        );
        drafts.new_tokens = 140;
        assert_eq!(t.decode_step("a", &drafts), StepPlan::VllmPath);
    }

    #[test]
    fn bad_input_changes_nothing() {
        assert!(RunningRequests::new(vec![full(0, 0)], true, 0, None).is_err());
        let mut t = RunningRequests::new(vec![full(16, 0)], true, 16, None).unwrap();
        t.sync("a", &[Some(1)], false, 16, None).unwrap();
        let before = t.room_asks("");
        let err = t
            .sync("a", &[Some(1), Some(2)], false, 16, None)
            .unwrap_err();
        assert!(err.to_string().contains("request a"), "{err}");
        assert!(t.note_removed("a", 5, &[]).is_err());
        assert_eq!(t.room_asks(""), before);
        assert_eq!(t.len(), 1);
    }
}
