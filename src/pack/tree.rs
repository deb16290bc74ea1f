use std::collections::HashSet;

use super::fxhash::FxHashMap;
use super::terms::loss_terms;
use super::{PackError, PackKind, PackedRow, Rollout, RowBuilder, Segment};

/// Key of a trie edge: parent node, token, next token (`END` for a rollout's last token).
type EdgeKey = (u32, i64, i64);
const END: i64 = i64::MIN;
const ROOT: u32 = 0;
const NONE: u32 = u32::MAX;

/// Rollouts of one micro-batch row folded into a prefix trie, so a token shared by several
/// rollouts is forwarded once.
///
/// A node is keyed on its token *and* the next one, so rollouts share a position only when they
/// also agree on what follows it: every packed position then predicts exactly one label, and a
/// fork costs one duplicated token per extra branch. A rollout's last token is keyed on "end",
/// which nobody extends, so every rollout ends on its own leaf. Any common prefix is shared,
/// across groups too.
///
/// Building is linear in tokens: one hash lookup per token in a single edge map, and children
/// kept as intrusive linked lists in insertion order (no allocation per node).
#[derive(Debug, Clone, Default)]
pub struct PrefixTree {
    rollouts: Vec<Rollout>,
    sources: Vec<usize>,
    rollout_nodes: Vec<Vec<u32>>,
    edges: FxHashMap<EdgeKey, u32>,
    token: Vec<i64>,
    first_child: Vec<u32>,
    last_child: Vec<u32>,
    next_sibling: Vec<u32>,
    child_count: Vec<u32>,
    visits: Vec<u32>,
    groups: HashSet<String>,
    trained: usize,
    raw_tokens: usize,
    load: u64,
}

impl PrefixTree {
    /// An empty tree.
    pub fn new() -> Self {
        let mut t = PrefixTree::default();
        t.push_node(-1);
        t
    }

    fn push_node(&mut self, token: i64) -> u32 {
        let id = self.token.len() as u32;
        self.token.push(token);
        self.first_child.push(NONE);
        self.last_child.push(NONE);
        self.next_sibling.push(NONE);
        self.child_count.push(0);
        self.visits.push(0);
        id
    }

    fn keys(ids: &[i64]) -> impl Iterator<Item = (i64, i64)> + '_ {
        ids.iter()
            .enumerate()
            .map(move |(i, &t)| (t, ids.get(i + 1).copied().unwrap_or(END)))
    }

    /// Unique tokens forwarded so far.
    pub fn unique_tokens(&self) -> usize {
        self.token.len() - 1
    }

    /// Loss terms so far.
    pub fn trained_tokens(&self) -> usize {
        self.trained
    }

    /// Rollouts added.
    pub fn len(&self) -> usize {
        self.rollouts.len()
    }

    /// Whether no rollout was added.
    pub fn is_empty(&self) -> bool {
        self.rollouts.is_empty()
    }

    /// Attention load: for every unique token, the length of the path it attends over
    /// (what balancing rows across ranks equalises).
    pub fn load(&self) -> u64 {
        self.load
    }

    /// Group ids present.
    pub fn groups(&self) -> &HashSet<String> {
        &self.groups
    }

    /// Tokens of `rollout` this tree does not hold yet.
    pub fn novel_tokens(&self, rollout: &Rollout) -> usize {
        let mut node = ROOT;
        let mut shared = 0;
        for (t, next) in Self::keys(&rollout.input_ids) {
            match self.edges.get(&(node, t, next)) {
                Some(&child) => {
                    node = child;
                    shared += 1;
                }
                None => break,
            }
        }
        rollout.input_ids.len() - shared
    }

    /// Whether adding `rollout` keeps the row within `budget` unique tokens and `budget`
    /// trained tokens (the second bound closes rows of identical rollouts, which add no token).
    pub fn fits(&self, rollout: &Rollout, budget: usize) -> bool {
        self.unique_tokens() + self.novel_tokens(rollout) <= budget && self.trained + rollout.trained() <= budget
    }

    /// Adds a rollout (validated; `row` names it in errors).
    pub fn add(&mut self, rollout: Rollout, row: usize) -> Result<(), PackError> {
        rollout.validate(row)?;
        let mut nodes = Vec::with_capacity(rollout.input_ids.len());
        let mut node = ROOT;
        for (depth, (t, next)) in Self::keys(&rollout.input_ids).enumerate() {
            let child = match self.edges.get(&(node, t, next)) {
                Some(&c) => c,
                None => {
                    let c = self.push_node(t);
                    self.edges.insert((node, t, next), c);
                    let last = self.last_child[node as usize];
                    if last == NONE {
                        self.first_child[node as usize] = c;
                    } else {
                        self.next_sibling[last as usize] = c;
                    }
                    self.last_child[node as usize] = c;
                    self.child_count[node as usize] += 1;
                    self.load += depth as u64 + 1;
                    c
                }
            };
            self.visits[child as usize] += 1;
            nodes.push(child);
            node = child;
        }
        self.trained += rollout.trained();
        self.raw_tokens += rollout.input_ids.len();
        self.groups.insert(rollout.group_id.clone());
        self.rollout_nodes.push(nodes);
        self.rollouts.push(rollout);
        self.sources.push(row);
        Ok(())
    }

    /// Lays the tree out in DFS pre-order (roots and children in insertion order), chains of
    /// single-child nodes merged into segments, and selects the loss terms. See [`PackedRow`].
    pub fn pack(&self) -> PackedRow {
        let n_nodes = self.token.len();
        let mut packed = vec![0u32; n_nodes];
        let mut input_ids = Vec::with_capacity(n_nodes - 1);
        let mut position_ids = Vec::with_capacity(n_nodes - 1);
        let mut cu_q = vec![0i32];
        let mut cu_k = vec![0i32];
        let mut kv: Vec<i64> = Vec::new();
        let mut segments: Vec<Segment> = Vec::new();
        // Stack of (first node of a segment, parent segment, depth); children pushed in reverse
        // so the first-inserted child is laid out first.
        let mut stack: Vec<(u32, Option<usize>, i64)> = Vec::new();
        let push_children = |stack: &mut Vec<(u32, Option<usize>, i64)>, node: u32, seg: Option<usize>, depth: i64| {
            let start = stack.len();
            let mut c = self.first_child[node as usize];
            while c != NONE {
                stack.push((c, seg, depth));
                c = self.next_sibling[c as usize];
            }
            stack[start..].reverse();
        };
        push_children(&mut stack, ROOT, None, 0);
        while let Some((first, parent, mut depth)) = stack.pop() {
            let start = input_ids.len();
            let mut node = first;
            loop {
                packed[node as usize] = input_ids.len() as u32;
                input_ids.push(self.token[node as usize]);
                position_ids.push(depth);
                depth += 1;
                if self.child_count[node as usize] != 1 {
                    break;
                }
                node = self.first_child[node as usize];
            }
            let end = input_ids.len();
            let seg = segments.len();
            let parent_path = parent.map_or(0..0, |p| cu_k[p] as usize..cu_k[p + 1] as usize);
            kv.extend_from_within(parent_path.clone());
            kv.extend(start as i64..end as i64);
            cu_q.push(end as i32);
            cu_k.push(kv.len() as i32);
            segments.push(Segment {
                start,
                len: end - start,
                parent,
                path_len: parent_path.len() + end - start,
                rollouts: self.visits[first as usize] as usize,
            });
            push_children(&mut stack, node, Some(seg), depth);
        }
        let rollout_positions: Vec<Vec<u32>> = self
            .rollout_nodes
            .iter()
            .map(|nodes| nodes.iter().map(|&n| packed[n as usize]).collect())
            .collect();
        let terms = loss_terms(&self.rollouts, &rollout_positions, input_ids.len());
        let max_q = segments.iter().map(|s| s.len).max().unwrap_or(0) as i32;
        let max_k = segments.iter().map(|s| s.path_len).max().unwrap_or(0) as i32;
        PackedRow {
            kind: PackKind::Tree,
            input_ids,
            position_ids,
            shift_labels: terms.shift_labels,
            tree_kv_index: kv,
            tree_cu_seqlens_q: cu_q,
            tree_cu_seqlens_k: cu_k,
            tree_max_seqlens: [max_q, max_k],
            token_index: terms.token_index,
            old_log_probs: terms.old_log_probs,
            advantages: terms.advantages,
            segment_id: terms.segment_id,
            segments,
            raw_tokens: self.raw_tokens,
            rollouts: self.rollouts.len(),
            rollout_positions,
        }
    }

    /// The rollouts added, in order.
    pub fn rollouts(&self) -> &[Rollout] {
        &self.rollouts
    }
}

impl RowBuilder for PrefixTree {
    const SHARES_TOKENS: bool = true;
    fn empty() -> Self {
        PrefixTree::new()
    }
    fn fits(&self, rollout: &Rollout, budget: usize) -> bool {
        PrefixTree::fits(self, rollout, budget)
    }
    fn novel_tokens(&self, rollout: &Rollout) -> usize {
        PrefixTree::novel_tokens(self, rollout)
    }
    fn holds_group(&self, group: &str) -> bool {
        self.groups.contains(group)
    }
    fn add(&mut self, rollout: Rollout, row: usize) -> Result<(), PackError> {
        PrefixTree::add(self, rollout, row)
    }
    fn load(&self) -> u64 {
        self.load
    }
    fn pack(&self) -> PackedRow {
        PrefixTree::pack(self)
    }
    fn rollouts(&self) -> &[Rollout] {
        &self.rollouts
    }
    fn sources(&self) -> &[usize] {
        &self.sources
    }
}
