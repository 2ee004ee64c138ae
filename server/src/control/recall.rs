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
        self.tokens.len() * 4 + self.salt.len()
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
    groups: HashMap<String, Group>,
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
        }
    }

    /// Bytes of prompts held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Prompts held in all groups.
    pub fn prompts(&self) -> usize {
        self.groups.values().map(|g| g.prompts.len()).sum()
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
        let g = self.groups.entry(group.to_string()).or_default();
        // The turns before this one in its conversation, and an identical prompt, go.
        let mut freed = 0;
        g.prompts.retain(|old| {
            let earlier = old.salt == p.salt && p.tokens.starts_with(&old.tokens);
            if earlier {
                freed += old.bytes();
            }
            !earlier
        });
        self.bytes -= freed;
        if g.prompts.len() >= PROMPTS_PER_GROUP {
            if let Some(old) = g.prompts.pop_front() {
                self.bytes -= old.bytes();
            }
        }
        self.bytes += p.bytes();
        g.prompts.push_back(Arc::new(p));
        let held = g.prompts.len();
        while self.bytes > self.capacity {
            self.drop_oldest();
        }
        Ok(self.groups.get(group).map_or(held, |g| g.prompts.len()))
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
        let oldest = self
            .groups
            .iter()
            .filter_map(|(name, g)| g.prompts.front().map(|p| (p.seq, name.clone())))
            .min();
        let Some((_, name)) = oldest else { return };
        if let Some(g) = self.groups.get_mut(&name) {
            if let Some(p) = g.prompts.pop_front() {
                self.bytes -= p.bytes();
            }
            if g.prompts.is_empty() {
                self.groups.remove(&name);
            }
        }
    }

    /// Drops the group whose newest prompt is the oldest.
    fn drop_stalest_group(&mut self) {
        let stalest = self
            .groups
            .iter()
            .map(|(name, g)| (g.prompts.back().map_or(0, |p| p.seq), name.clone()))
            .min();
        if let Some((_, name)) = stalest {
            if let Some(g) = self.groups.remove(&name) {
                self.bytes -= g.prompts.iter().map(|p| p.bytes()).sum::<usize>();
            }
        }
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
        assert_eq!(r.bytes(), (20 + 10 + 10) * 4 + 1);
    }

    #[test]
    fn the_byte_budget_drops_the_oldest_prompt_of_any_group() {
        let mut r = Recall::new(100 * 4);
        let now = Instant::now();
        r.remember("a", String::new(), toks(0..40), now).unwrap();
        r.remember("b", String::new(), toks(1000..1040), now)
            .unwrap();
        r.remember("a", String::new(), toks(2000..2040), now)
            .unwrap();
        assert!(r.bytes() <= 400);
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
        assert_eq!(r.bytes(), MAX_GROUPS * 4);
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
