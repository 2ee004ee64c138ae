//! Prompts remembered for warming a replacement engine (protocol `Remember` and `Recall`).
//!
//! A restarted vLLM engine starts with an empty GPU prefix cache: its conversations' next turns
//! all load their prefixes from kvd at once, the first turn paying for the burst. A replica that
//! names itself (`kvd.warm_group`) has its connector remember each prompt it served here; the
//! replacement is warmed before it takes traffic by replaying the newest of them
//! (`python -m kvd.warm`), each a kvd hit, so its first turns are GPU hits.
//!
//! Bounded in three ways: at most [`PROMPTS_PER_GROUP`] prompts a group, at most
//! [`MAX_GROUPS`] groups, and `--recall-mb` of tokens in all (the oldest prompt of any group goes
//! first). A prompt that extends one the group holds (the next turn of a conversation) replaces
//! it, so a group's prompts are mostly distinct conversations.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tokio::time::Instant;

/// Most prompts one group keeps.
pub const PROMPTS_PER_GROUP: usize = 256;
/// Most groups kept; a new group beyond it takes the place of the least recently remembered.
pub const MAX_GROUPS: usize = 1024;
/// Longest group name, in bytes.
pub const MAX_GROUP_BYTES: usize = 256;
/// Longest prompt kept, in tokens: its `Recall` reply (4 bytes a token) must fit the 64 MiB
/// frame kvd's clients take.
pub const MAX_PROMPT_TOKENS: usize = 1 << 22;
/// What a prompt costs beyond its tokens and salt, counted against `--recall-mb`.
const PROMPT_OVERHEAD: usize = 64;

/// One remembered prompt.
#[derive(Debug)]
pub struct Prompt {
    /// The request's `cache_salt` ("" for none).
    pub salt: String,
    /// Its token ids.
    pub tokens: Vec<u32>,
    /// When it was remembered.
    pub at: Instant,
    seq: u64,
}

impl Prompt {
    fn bytes(&self) -> usize {
        self.tokens.len() * 4 + self.salt.len() + PROMPT_OVERHEAD
    }
}

#[derive(Debug, Default)]
struct Group {
    /// Oldest first.
    prompts: VecDeque<Arc<Prompt>>,
}

/// The remembered prompts of every group.
#[derive(Debug)]
pub struct Recall {
    capacity: usize,
    bytes: usize,
    seq: u64,
    groups: HashMap<Arc<str>, Group>,
    /// Every prompt kept, by age: `(seq, group)`, oldest first. Entries of prompts gone
    /// another way (replaced, a group's cap, a group dropped) stay until they reach the front
    /// and are skipped there, so an eviction costs O(1) amortized; compacted when stale
    /// entries outnumber live ones.
    order: VecDeque<(u64, Arc<str>)>,
    held: usize,
}

/// Why a prompt was not remembered; the message names the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused(pub String);

impl Recall {
    /// An empty store of at most `capacity` bytes of prompts (0: remembering is off).
    pub fn new(capacity: usize) -> Self {
        Recall {
            capacity,
            bytes: 0,
            seq: 0,
            groups: HashMap::new(),
            order: VecDeque::new(),
            held: 0,
        }
    }

    /// Bytes of prompts held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Prompts held in all groups.
    pub fn prompts(&self) -> usize {
        self.held
    }

    /// Keeps `tokens` as the newest prompt of `group`; returns the group's prompt count.
    pub fn remember(
        &mut self,
        group: &str,
        salt: String,
        tokens: Vec<u32>,
        now: Instant,
    ) -> Result<usize, Refused> {
        if self.capacity == 0 {
            return Err(Refused(
                "this kvd remembers no prompts (--recall-mb 0): start it with --recall-mb 256, \
                 or drop kvd.warm_group from the connector's config"
                    .into(),
            ));
        }
        check_group(group)?;
        if tokens.is_empty() {
            return Err(Refused("an empty prompt: send its token ids".into()));
        }
        if tokens.len() > MAX_PROMPT_TOKENS {
            return Err(Refused(format!(
                "a prompt of {} tokens: kvd remembers prompts of at most {MAX_PROMPT_TOKENS} \
                 tokens (a warm replays no longer ones)",
                tokens.len()
            )));
        }
        self.seq += 1;
        let p = Prompt {
            salt,
            tokens,
            at: now,
            seq: self.seq,
        };
        if p.bytes() > self.capacity {
            return Err(Refused(format!(
                "a prompt of {} tokens is larger than --recall-mb ({} MiB): raise it to keep \
                 prompts this long",
                p.tokens.len(),
                self.capacity >> 20
            )));
        }
        if !self.groups.contains_key(group) && self.groups.len() >= MAX_GROUPS {
            self.drop_stalest_group();
        }
        let name: Arc<str> = match self.groups.get_key_value(group) {
            Some((k, _)) => k.clone(),
            None => Arc::from(group),
        };
        let g = self.groups.entry(name.clone()).or_default();
        // The turns before this one in its conversation, and an identical prompt, go.
        let (mut freed, before) = (0, g.prompts.len());
        g.prompts.retain(|old| {
            let earlier = old.salt == p.salt && p.tokens.starts_with(&old.tokens);
            if earlier {
                freed += old.bytes();
            }
            !earlier
        });
        let mut gone = before - g.prompts.len();
        if g.prompts.len() >= PROMPTS_PER_GROUP {
            if let Some(old) = g.prompts.pop_front() {
                freed += old.bytes();
                gone += 1;
            }
        }
        self.bytes = self.bytes - freed + p.bytes();
        self.held = self.held - gone + 1;
        self.order.push_back((p.seq, name.clone()));
        g.prompts.push_back(Arc::new(p));
        while self.bytes > self.capacity {
            self.drop_oldest();
        }
        if self.order.len() > 2 * self.held + 1024 {
            self.compact();
        }
        Ok(self.groups.get(group).map_or(0, |g| g.prompts.len()))
    }

    /// The `index`-th newest prompt of `group` (0 the newest), and how many it holds.
    pub fn recall(&self, group: &str, index: usize) -> (Option<Arc<Prompt>>, usize) {
        match self.groups.get(group) {
            Some(g) => {
                let n = g.prompts.len();
                let p = n
                    .checked_sub(index + 1)
                    .and_then(|i| g.prompts.get(i))
                    .cloned();
                (p, n)
            }
            None => (None, 0),
        }
    }

    /// Drops the oldest prompt of any group (and a group left empty).
    fn drop_oldest(&mut self) {
        while let Some((seq, name)) = self.order.pop_front() {
            let Some(g) = self.groups.get_mut(&name) else {
                continue; // its group was dropped
            };
            if g.prompts.front().map(|p| p.seq) != Some(seq) {
                continue; // gone another way
            }
            if let Some(p) = g.prompts.pop_front() {
                self.bytes -= p.bytes();
                self.held -= 1;
            }
            if g.prompts.is_empty() {
                self.groups.remove(&name);
            }
            return;
        }
    }

    /// Drops the group whose newest prompt is the oldest (its entries in `order` go stale).
    fn drop_stalest_group(&mut self) {
        let stalest = self
            .groups
            .iter()
            .map(|(name, g)| (g.prompts.back().map_or(0, |p| p.seq), name))
            .min()
            .map(|(_, name)| name.clone());
        if let Some(g) = stalest.and_then(|name| self.groups.remove(&name)) {
            self.bytes -= g.prompts.iter().map(|p| p.bytes()).sum::<usize>();
            self.held -= g.prompts.len();
        }
    }

    /// Rebuilds `order` from the prompts held.
    fn compact(&mut self) {
        let mut live: Vec<(u64, Arc<str>)> = self
            .groups
            .iter()
            .flat_map(|(name, g)| g.prompts.iter().map(move |p| (p.seq, name.clone())))
            .collect();
        live.sort_unstable_by_key(|(seq, _)| *seq);
        self.order = live.into();
    }
}

/// A group name is 1 to [`MAX_GROUP_BYTES`] bytes.
pub fn check_group(group: &str) -> Result<(), Refused> {
    if group.is_empty() || group.len() > MAX_GROUP_BYTES {
        return Err(Refused(format!(
            "a group name of {} bytes: name the replica in 1 to {MAX_GROUP_BYTES} bytes \
             (kvd.warm_group)",
            group.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(r: std::ops::Range<u32>) -> Vec<u32> {
        r.collect()
    }

    #[test]
    fn the_newest_prompt_comes_first_and_past_the_last_is_none() {
        let mut r = Recall::new(1 << 20);
        let now = Instant::now();
        r.remember("a", String::new(), toks(0..10), now).unwrap();
        r.remember("a", String::new(), toks(100..110), now).unwrap();
        assert_eq!(r.recall("a", 0).0.unwrap().tokens, toks(100..110));
        assert_eq!(r.recall("a", 1).0.unwrap().tokens, toks(0..10));
        assert!(r.recall("a", 2).0.is_none());
        assert_eq!(r.recall("a", 2).1, 2);
        let (none, held) = r.recall("b", 0);
        assert!(none.is_none() && held == 0);
    }

    #[test]
    fn a_later_turn_replaces_the_turns_it_extends_but_not_another_salts() {
        let mut r = Recall::new(1 << 20);
        let now = Instant::now();
        r.remember("a", String::new(), toks(0..10), now).unwrap();
        r.remember("a", "s".into(), toks(0..10), now).unwrap();
        r.remember("a", String::new(), toks(50..60), now).unwrap();
        assert_eq!(r.remember("a", String::new(), toks(0..20), now), Ok(3));
        assert_eq!(r.recall("a", 0).0.unwrap().tokens, toks(0..20));
        assert_eq!(r.recall("a", 1).0.unwrap().tokens, toks(50..60));
        assert_eq!(r.recall("a", 2).0.unwrap().salt, "s");
        assert_eq!(r.bytes(), (20 + 10 + 10) * 4 + 1 + 3 * PROMPT_OVERHEAD);
    }

    #[test]
    fn the_byte_budget_drops_the_oldest_prompt_of_any_group() {
        let one = 40 * 4 + PROMPT_OVERHEAD;
        let mut r = Recall::new(2 * one + 10);
        let now = Instant::now();
        r.remember("a", String::new(), toks(0..40), now).unwrap();
        r.remember("b", String::new(), toks(1000..1040), now)
            .unwrap();
        r.remember("a", String::new(), toks(2000..2040), now)
            .unwrap();
        assert_eq!(r.bytes(), 2 * one);
        assert_eq!(r.recall("a", 0).0.unwrap().tokens, toks(2000..2040));
        assert_eq!(r.recall("a", 1).1, 1, "a's first prompt was the oldest");
        assert_eq!(r.recall("b", 0).1, 1);
    }

    #[test]
    fn a_group_keeps_its_newest_prompts_and_groups_are_bounded() {
        let mut r = Recall::new(64 << 20);
        let now = Instant::now();
        for i in 0..(PROMPTS_PER_GROUP as u32 + 5) {
            r.remember("a", String::new(), vec![i, 1_000_000], now)
                .unwrap();
        }
        assert_eq!(r.recall("a", 0).1, PROMPTS_PER_GROUP);
        assert_eq!(r.recall("a", PROMPTS_PER_GROUP - 1).0.unwrap().tokens[0], 5);
        for i in 0..MAX_GROUPS {
            r.remember(&format!("g{i}"), String::new(), vec![1], now)
                .unwrap();
        }
        assert_eq!(r.recall("a", 0).1, 0, "a was the stalest group");
        assert_eq!(r.prompts(), MAX_GROUPS);
        assert_eq!(r.bytes(), MAX_GROUPS * (4 + PROMPT_OVERHEAD));
    }

    /// The counters against a recount, and the age order against the prompts' own, through
    /// thousands of evictions, replacements, group caps and dropped groups.
    #[test]
    fn bookkeeping_holds_through_every_way_a_prompt_goes() {
        let one = 8 * 4 + PROMPT_OVERHEAD;
        let mut r = Recall::new(300 * one);
        let now = Instant::now();
        let mut x: u32 = 1;
        for i in 0..20_000u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let group = format!("g{}", x % 1200);
            // Every third prompt extends the group's newest, as a conversation's next turn.
            let tokens = match (i % 3, r.recall(&group, 0).0) {
                (0, Some(p)) if p.tokens.len() < 64 => [p.tokens.clone(), vec![i]].concat(),
                _ => vec![i; 8],
            };
            r.remember(&group, String::new(), tokens, now).unwrap();
            assert!(r.bytes() <= 300 * one);
        }
        let prompts: Vec<&Arc<Prompt>> = r.groups.values().flat_map(|g| g.prompts.iter()).collect();
        assert_eq!(r.prompts(), prompts.len());
        assert_eq!(r.bytes(), prompts.iter().map(|p| p.bytes()).sum::<usize>());
        assert!(r.groups.len() <= MAX_GROUPS && r.groups.values().all(|g| !g.prompts.is_empty()));
        assert!(r.order.len() <= 2 * r.prompts() + 1024);
        // Every held prompt is in `order`, in age order.
        let live: Vec<u64> = r
            .order
            .iter()
            .filter(|(seq, name)| {
                r.groups
                    .get(name)
                    .is_some_and(|g| g.prompts.iter().any(|p| p.seq == *seq))
            })
            .map(|(seq, _)| *seq)
            .collect();
        assert_eq!(live.len(), r.prompts());
        assert!(live.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn refusals_name_the_fix_and_keep_nothing() {
        let mut off = Recall::new(0);
        let now = Instant::now();
        let e = off.remember("a", String::new(), vec![1], now).unwrap_err();
        assert!(e.0.contains("--recall-mb"), "{e:?}");
        let mut r = Recall::new(40);
        assert!(r.remember("", String::new(), vec![1], now).is_err());
        assert!(r
            .remember(
                &"x".repeat(MAX_GROUP_BYTES + 1),
                String::new(),
                vec![1],
                now
            )
            .is_err());
        assert!(r.remember("a", String::new(), Vec::new(), now).is_err());
        let e = r
            .remember("a", String::new(), toks(0..11), now)
            .unwrap_err();
        assert!(e.0.contains("raise it"), "{e:?}");
        assert_eq!((r.prompts(), r.bytes()), (0, 0));
    }
}
