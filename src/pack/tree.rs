use std::collections::HashSet;

use super::error::PackError;
use super::fxhash::FxHashMap;
use super::planner::RowBuilder;
use super::rollout::Rollout;
use super::row::{PackKind, PackedRow, Segment};
use super::terms::loss_terms;

/// Every rollout in one prefix tree, packed as one row (errors name the malformed rollout):
/// the tree twin of [`super::pack_flat`], without a token budget (the planner splits by one).
pub fn pack_tree(rollouts: &[Rollout]) -> Result<PackedRow, PackError> {
    let mut tree = PrefixTree::new();
    for (i, r) in rollouts.iter().enumerate() {
        tree.add(r.clone(), i)?;
    }
    Ok(tree.pack())
}

/// Key of a trie edge: parent node, token, next token (`END` for a rollout's last token).
type EdgeKey = (u32, i64, i64);
const END: i64 = i64::MIN;
const ROOT: u32 = 0;
const NONE: u32 = u32::MAX;
/// A node's children are found by walking its child list up to this many; past it (the root
/// under many groups, a wide fork) they are also indexed in the edge map.
const LISTED_CHILDREN: u32 = 8;

/// One trie node: its token and the next one (its key), its children as an intrusive linked
/// list in insertion order, and how many rollouts pass through it. One cache line a node, so
/// walking a shared chain (consecutive ids) reads memory in order.
#[derive(Debug, Clone, Copy)]
struct Node {
    token: i64,
    next: i64,
    first_child: u32,
    last_child: u32,
    next_sibling: u32,
    child_count: u32,
    visits: u32,
}

/// Rollouts of one micro-batch row folded into a prefix trie, so a token shared by several
/// rollouts is forwarded once.
///
/// A node is keyed on its token *and* the next one, so rollouts share a position only when they
/// also agree on what follows it: every packed position then predicts exactly one label, and a
/// fork costs one duplicated token per extra branch. A rollout's last token is keyed on "end",
/// which nobody extends, so every rollout ends on its own leaf. Any common prefix is shared,
/// across groups too.
///
/// Building is linear in tokens: a token is found among its parent's few children in their
/// list (a wide node's in one edge map), and children are intrusive linked lists in insertion
/// order (no allocation per node).
#[derive(Debug, Clone, Default)]
pub struct PrefixTree {
    rollouts: Vec<Rollout>,
    sources: Vec<usize>,
    rollout_nodes: Vec<Vec<u32>>,
    /// Children of nodes with more than [`LISTED_CHILDREN`] of them.
    edges: FxHashMap<EdgeKey, u32>,
    nodes: Vec<Node>,
    groups: HashSet<String>,
    trained: usize,
    raw_tokens: usize,
    load: u64,
}

impl PrefixTree {
    /// An empty tree.
    pub fn new() -> Self {
        let mut t = PrefixTree::default();
        t.push_node(-1, END);
        t
    }

    fn push_node(&mut self, token: i64, next: i64) -> u32 {
        let id = self.nodes.len() as u32;
        self.nodes.push(Node {
            token,
            next,
            first_child: NONE,
            last_child: NONE,
            next_sibling: NONE,
            child_count: 0,
            visits: 0,
        });
        id
    }

    /// The child of `node` keyed `(token, next)`, if any.
    fn child(&self, node: u32, token: i64, next: i64) -> Option<u32> {
        let n = &self.nodes[node as usize];
        if n.child_count > LISTED_CHILDREN {
            return self.edges.get(&(node, token, next)).copied();
        }
        let mut c = n.first_child;
        while c != NONE {
            let child = &self.nodes[c as usize];
            if child.token == token && child.next == next {
                return Some(c);
            }
            c = child.next_sibling;
        }
        None
    }

    /// A new child of `node` keyed `(token, next)`, last in its list; a node that grows past
    /// [`LISTED_CHILDREN`] gets all its children indexed.
    fn add_child(&mut self, node: u32, token: i64, next: i64) -> u32 {
        let c = self.push_node(token, next);
        let parent = &mut self.nodes[node as usize];
        let last = parent.last_child;
        parent.last_child = c;
        parent.child_count += 1;
        let count = parent.child_count;
        if last == NONE {
            parent.first_child = c;
        } else {
            self.nodes[last as usize].next_sibling = c;
        }
        if count == LISTED_CHILDREN + 1 {
            let mut k = self.nodes[node as usize].first_child;
            while k != NONE {
                let n = self.nodes[k as usize];
                self.edges.insert((node, n.token, n.next), k);
                k = n.next_sibling;
            }
        } else if count > LISTED_CHILDREN {
            self.edges.insert((node, token, next), c);
        }
        c
    }

    fn keys(ids: &[i64]) -> impl Iterator<Item = (i64, i64)> + '_ {
        ids.iter()
            .enumerate()
            .map(move |(i, &t)| (t, ids.get(i + 1).copied().unwrap_or(END)))
    }

    /// Unique tokens forwarded so far.
    pub fn unique_tokens(&self) -> usize {
        self.nodes.len() - 1
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
    pub(crate) fn novel_tokens(&self, rollout: &Rollout) -> usize {
        let mut node = ROOT;
        let mut shared = 0;
        for (t, next) in Self::keys(&rollout.input_ids) {
            match self.child(node, t, next) {
                Some(child) => {
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
            let child = match self.child(node, t, next) {
                Some(c) => c,
                None => {
                    self.load += depth as u64 + 1;
                    self.add_child(node, t, next)
                }
            };
            self.nodes[child as usize].visits += 1;
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
        let n_nodes = self.nodes.len();
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
            let mut c = self.nodes[node as usize].first_child;
            while c != NONE {
                stack.push((c, seg, depth));
                c = self.nodes[c as usize].next_sibling;
            }
            stack[start..].reverse();
        };
        push_children(&mut stack, ROOT, None, 0);
        while let Some((first, parent, mut depth)) = stack.pop() {
            let start = input_ids.len();
            let mut node = first;
            loop {
                let n = &self.nodes[node as usize];
                packed[node as usize] = input_ids.len() as u32;
                input_ids.push(n.token);
                position_ids.push(depth);
                depth += 1;
                if n.child_count != 1 {
                    break;
                }
                node = n.first_child;
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
                rollouts: self.nodes[first as usize].visits as usize,
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
            sources: self.sources.clone(),
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
