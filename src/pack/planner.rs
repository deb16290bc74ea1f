use super::{PackError, PrefixTree, Rollout};

/// Rows per data-parallel rank, each a prefix tree ready to pack.
#[derive(Debug, Clone)]
pub struct PackPlan {
    /// `ranks[r]` = the rows rank `r` forwards, in order.
    pub ranks: Vec<Vec<PrefixTree>>,
}

impl PackPlan {
    /// All rows, rank by rank.
    pub fn rows(&self) -> impl Iterator<Item = &PrefixTree> {
        self.ranks.iter().flatten()
    }
}

/// Fills micro-batch rows under a token budget counted on *unique* tokens (and on trained
/// tokens, so rows of identical rollouts still close), then spreads rows over `ranks` by
/// attention load (longest first, each to the least-loaded rank).
///
/// A rollout goes to a row already holding its group (its prompt is there), else to the row
/// where it adds the fewest new tokens, else to a new row. A rollout larger than the budget is
/// an error naming it.
pub fn plan(rollouts: Vec<Rollout>, budget: usize, ranks: usize) -> Result<PackPlan, PackError> {
    if budget == 0 {
        return Err(PackError::Zero("budget"));
    }
    if ranks == 0 {
        return Err(PackError::Zero("ranks"));
    }
    let mut rows: Vec<PrefixTree> = Vec::new();
    for (i, r) in rollouts.into_iter().enumerate() {
        r.validate(i)?;
        if r.input_ids.len() > budget || r.trained() > budget {
            return Err(PackError::OverBudget {
                row: i,
                tokens: r.input_ids.len(),
                trained: r.trained(),
                budget,
            });
        }
        let same_group = rows
            .iter()
            .position(|t| t.groups().contains(&r.group_id) && t.fits(&r, budget));
        let target = same_group.or_else(|| {
            rows.iter()
                .enumerate()
                .filter(|(_, t)| t.fits(&r, budget))
                .min_by_key(|(_, t)| t.novel_tokens(&r))
                .map(|(j, _)| j)
        });
        let j = match target {
            Some(j) => j,
            None => {
                rows.push(PrefixTree::new());
                rows.len() - 1
            }
        };
        rows[j].add(r, i)?;
    }
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&j| std::cmp::Reverse(rows[j].load()));
    let mut slots: Vec<Option<PrefixTree>> = rows.into_iter().map(Some).collect();
    let mut plan = PackPlan {
        ranks: (0..ranks).map(|_| Vec::new()).collect(),
    };
    let mut loads = vec![0u64; ranks];
    let mut placed: Vec<Vec<usize>> = vec![Vec::new(); ranks];
    for j in order {
        let r = (0..ranks).min_by_key(|&r| (loads[r], r)).unwrap_or(0);
        loads[r] += slots[j].as_ref().map_or(0, PrefixTree::load);
        placed[r].push(j);
    }
    // Within a rank, rows keep the order they were opened in.
    for (r, mut rows) in placed.into_iter().enumerate() {
        rows.sort_unstable();
        plan.ranks[r] = rows.into_iter().filter_map(|j| slots[j].take()).collect();
    }
    Ok(plan)
}
