//! What a coordinator knows about its running requests' block tables, per KV-cache group:
//! how many blocks each request holds, how far its window's blocks are already freed, and
//! the pages it lacks for its decode room. It answers, in one call per request and step,
//! what vLLM's scheduler would otherwise make the managers walk every group for:
//!
//! * [`RunningRequests::decode_step`] (and [`RunningRequests::plan_step`] under it): what
//!   `allocate_slots` for a running request's step would do ([`StepPlan`]): nothing (then
//!   vLLM's answer is the empty `KVCacheBlocks`, and the call can return at once), only
//!   take blocks in full-attention groups (then the caller allocates just those), or
//!   anything else (vLLM's rules run);
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
    /// Only groups that never skip tokens (full attention) take blocks, this many per
    /// group (0 elsewhere); nothing is freed or cached.
    Grow(Vec<u64>),
    /// Anything else (or a request the table does not hold): run vLLM's rules.
    VllmPath,
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
/// slots in all with `processed` tokens safely computed (see [`StepPlan`]).
fn plan_entry(rules: &[GroupRule], entry: &Entry, slots: u64, processed: u64) -> StepPlan {
    if entry.partial_hit {
        return StepPlan::VllmPath;
    }
    let mut needs = Vec::new();
    for (g, rule) in rules.iter().enumerate() {
        let Some(held) = entry.held[g] else {
            return StepPlan::VllmPath;
        };
        // Blocks past those held: vLLM's `get_num_blocks_to_allocate`.
        let need = slots
            .saturating_add(rule.extra_slots)
            .div_ceil(rule.block_size)
            .saturating_sub(held);
        if let Some(offset) = rule.skip_offset {
            // `remove_skipped_blocks` frees back from its last skipped block and
            // stops at a freed one: nothing to do if that block is freed already.
            let last = (processed.saturating_sub(offset) / rule.block_size).min(held);
            if last > entry.removed[g] || need > 0 {
                // A window moves, or a windowed group grows: vLLM's rules.
                return StepPlan::VllmPath;
            }
        }
        if need > 0 {
            if needs.is_empty() {
                needs = vec![0; rules.len()];
            }
            needs[g] = need;
        }
    }
    if needs.is_empty() {
        StepPlan::Quiet
    } else {
        StepPlan::Grow(needs)
    }
}

/// The running requests of one coordinator (see the module's documentation).
#[derive(Debug, Clone)]
pub struct RunningRequests {
    rules: Vec<GroupRule>,
    quiet_steps: bool,
    room_tokens: u64,
    entries: FxHashMap<String, Entry>,
    /// Per group: the pages all requests lack for their room.
    room_totals: Vec<u64>,
}

impl RunningRequests {
    /// A table for groups with these rules. `quiet_steps`: whether [`Self::quiet_step`]
    /// may answer "quiet" at all (the coordinator's managers' rules are all modelled);
    /// `room_tokens`: each running request's decode room (0: none kept).
    pub fn new(
        rules: Vec<GroupRule>,
        quiet_steps: bool,
        room_tokens: u64,
    ) -> Result<Self, PoolError> {
        if let Some((g, _)) = rules.iter().enumerate().find(|(_, r)| r.block_size == 0) {
            return Err(PoolError::InvalidArgument(format!(
                "group {g}: block size 0"
            )));
        }
        let n = rules.len();
        Ok(Self {
            rules,
            quiet_steps,
            room_tokens,
            entries: FxHashMap::default(),
            room_totals: vec![0; n],
        })
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
    /// and the request's length for its room. A request no group holds blocks for is
    /// not running (refused, or not admitted yet) and is forgotten.
    pub fn sync(
        &mut self,
        request_id: &str,
        held: &[Option<u64>],
        partial_hit: bool,
        room_length: u64,
    ) -> Result<(), PoolError> {
        self.check_groups(request_id, held.len(), "block counts")?;
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
        });
        entry.held.copy_from_slice(held);
        entry.partial_hit = partial_hit;
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

    /// After vLLM's `remove_skipped_blocks(request_id, processed)`, with the blocks each
    /// group held then: every block before `min(skipped // block_size, held)` is freed.
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
    /// Reads the table only.
    pub fn plan_step(&self, request_id: &str, slots: u64, processed: u64) -> StepPlan {
        match self.entries.get(request_id) {
            Some(entry) if self.quiet_steps => plan_entry(&self.rules, entry, slots, processed),
            _ => StepPlan::VllmPath,
        }
    }

    /// [`Self::plan_step`], recounting a quiet step's room at `room_length` (the step's
    /// own bookkeeping; a step that grows is told with [`Self::sync`] once its blocks are
    /// allocated). One lookup of the request: this is the scheduler's hot path.
    fn step(&mut self, request_id: &str, slots: u64, processed: u64, room_length: u64) -> StepPlan {
        if !self.quiet_steps {
            return StepPlan::VllmPath;
        }
        let Some(entry) = self.entries.get_mut(request_id) else {
            return StepPlan::VllmPath;
        };
        let plan = plan_entry(&self.rules, entry, slots, processed);
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
    /// recounted at `room_length`.
    pub fn quiet_step(
        &mut self,
        request_id: &str,
        slots: u64,
        processed: u64,
        room_length: u64,
    ) -> bool {
        self.step(request_id, slots, processed, room_length) == StepPlan::Quiet
    }

    /// [`Self::plan_step`] for a decode step given as vLLM's scheduler asks for it; a
    /// quiet step's room is recounted.
    pub fn decode_step(&mut self, request_id: &str, step: &DecodeStep) -> StepPlan {
        self.step(
            request_id,
            step.slots(),
            step.processed(),
            step.room_length(),
        )
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

    fn full(size: u64, pool: usize) -> GroupRule {
        GroupRule {
            block_size: size,
            extra_slots: 0,
            skip_offset: None,
            room_pool: Some(pool),
        }
    }

    fn window(size: u64, offset: u64) -> GroupRule {
        GroupRule {
            block_size: size,
            extra_slots: 0,
            skip_offset: Some(offset),
            room_pool: None,
        }
    }

    #[test]
    fn a_step_inside_held_blocks_is_quiet_and_one_past_them_is_not() {
        let mut t = RunningRequests::new(vec![full(16, 0)], true, 0).unwrap();
        assert!(
            !t.quiet_step("a", 10, 9, 0),
            "unknown requests are never quiet"
        );
        t.sync("a", &[Some(2)], false, 0).unwrap();
        assert!(t.quiet_step("a", 32, 31, 0));
        assert!(!t.quiet_step("a", 33, 32, 0));
        t.sync("a", &[Some(2)], true, 0).unwrap();
        assert!(
            !t.quiet_step("a", 20, 19, 0),
            "a pending prefix hit is never quiet"
        );
        t.forget("a");
        assert!(!t.quiet_step("a", 20, 19, 0));
    }

    #[test]
    fn window_steps_are_quiet_only_until_a_block_leaves_the_window() {
        // Sliding window of 32 tokens: skipped = processed - 31.
        let mut t = RunningRequests::new(vec![window(16, 31)], true, 0).unwrap();
        t.sync("a", &[Some(8)], false, 0).unwrap();
        // processed 46: 15 skipped, no block leaves.
        assert!(t.quiet_step("a", 100, 46, 0));
        // processed 47: 16 skipped, block 0 leaves, and vLLM has not freed it yet.
        assert!(!t.quiet_step("a", 100, 47, 0));
        t.note_removed("a", 47, &[Some(8)]).unwrap();
        assert!(t.quiet_step("a", 100, 62, 0));
        assert!(!t.quiet_step("a", 100, 63, 0));
        // Freed blocks are capped at those held when vLLM freed them.
        t.note_removed("a", 1000, &[Some(3)]).unwrap();
        t.sync("a", &[Some(8)], false, 0).unwrap();
        assert!(t.quiet_step("a", 100, 31 + 16 * 3, 0));
        assert!(!t.quiet_step("a", 100, 31 + 16 * 4, 0));
    }

    #[test]
    fn room_totals_follow_each_request() {
        // Full attention (pool 3) and a Mamba-like state: one block, skipped = processed - 1.
        let mut t = RunningRequests::new(vec![full(16, 3), window(4096, 1)], true, 40).unwrap();
        t.sync("a", &[Some(2), Some(1)], false, 20).unwrap(); // needs ceil(60/16)=4: lacks 2
        t.sync("b", &[Some(1), Some(1)], false, 10).unwrap(); // ceil(50/16)=4: lacks 3
        assert_eq!(t.room_asks(""), vec![(3, 5)]);
        assert_eq!(t.room_asks("a"), vec![(3, 3)]);
        assert!(t.quiet_step("a", 24, 23, 30)); // ceil(70/16)=5: lacks 3
        assert_eq!(t.room_asks("b"), vec![(3, 3)]);
        t.sync("b", &[None, None], false, 10).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t.room_asks(""), vec![(3, 3)]);
        t.forget("a");
        t.forget("a");
        assert!(t.is_empty());
        assert_eq!(t.room_asks(""), vec![]);
    }

    #[test]
    fn without_quiet_steps_only_the_room_is_kept() {
        let mut t = RunningRequests::new(vec![full(16, 0)], false, 16).unwrap();
        t.sync("a", &[Some(4)], false, 16).unwrap();
        assert!(!t.quiet_step("a", 17, 16, 16));
        assert_eq!(t.room_asks(""), vec![]);
        t.sync("a", &[Some(1)], false, 16).unwrap();
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
        let mut t = RunningRequests::new(vec![full(16, 0)], true, 16).unwrap();
        t.sync("a", &[Some(7)], false, 100).unwrap();
        assert_eq!(t.decode_step("a", &step), StepPlan::Quiet);
        assert_eq!(
            t.room_asks(""),
            vec![(0, 1)],
            "ceil((101 + 16) / 16) = 8 pages"
        );
    }

    #[test]
    fn a_step_past_held_blocks_grows_only_groups_without_a_window() {
        let mut t =
            RunningRequests::new(vec![full(16, 0), window(4096, 1), full(32, 1)], true, 0).unwrap();
        t.sync("a", &[Some(2), Some(1), Some(1)], false, 0).unwrap();
        assert_eq!(t.plan_step("a", 32, 31), StepPlan::Quiet);
        assert_eq!(t.plan_step("a", 33, 32), StepPlan::Grow(vec![1, 0, 1]));
        assert_eq!(t.plan_step("a", 50, 49), StepPlan::Grow(vec![2, 0, 1]));
        // The state group would need a second block: vLLM's rules.
        assert_eq!(t.plan_step("a", 4097, 4096), StepPlan::VllmPath);
        // Its window moves (processed 4097: one state block skipped): vLLM's rules.
        t.sync("a", &[Some(300), Some(1), Some(200)], false, 0)
            .unwrap();
        assert_eq!(t.plan_step("a", 4096, 4097), StepPlan::VllmPath);
        t.note_removed("a", 4097, &[Some(300), Some(1), Some(200)])
            .unwrap();
        assert_eq!(t.plan_step("a", 4096, 4097), StepPlan::Quiet);
        assert_eq!(t.plan_step("b", 1, 0), StepPlan::VllmPath);
        let off = RunningRequests::new(vec![full(16, 0)], false, 0).unwrap();
        assert_eq!(off.plan_step("a", 1, 0), StepPlan::VllmPath);
    }

    #[test]
    fn bad_input_changes_nothing() {
        assert!(RunningRequests::new(vec![full(0, 0)], true, 0).is_err());
        let mut t = RunningRequests::new(vec![full(16, 0)], true, 16).unwrap();
        t.sync("a", &[Some(1)], false, 16).unwrap();
        let before = t.room_asks("");
        let err = t.sync("a", &[Some(1), Some(2)], false, 16).unwrap_err();
        assert!(err.to_string().contains("request a"), "{err}");
        assert!(t.note_removed("a", 5, &[]).is_err());
        assert_eq!(t.room_asks(""), before);
        assert_eq!(t.len(), 1);
    }
}
