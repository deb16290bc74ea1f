use super::error::PackError;
use super::rollout::Rollout;
use super::row::PackedRow;
use super::sequence::FlatRow;
use super::tree::PrefixTree;

/// How rollouts share a packed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Packing {
    /// Prefix trees: each shared prefix forwarded once.
    #[default]
    Tree,
    /// Sequence packing: every rollout forwarded whole, for comparison.
    Flat,
}

impl Packing {
    /// Plans `rollouts` into rows of at most `budget` tokens (unique tokens for trees) spread
    /// over `ranks`, and packs them: `rows[rank]`. The one place the packing mode is looked at;
    /// the planner, the row contract and the loss are the same for both.
    pub fn plan(self, rollouts: Vec<Rollout>, budget: usize, ranks: usize) -> Result<Vec<Vec<PackedRow>>, PackError> {
        match self {
            Packing::Tree => Ok(plan_rows::<PrefixTree>(rollouts, budget, ranks)?.packed()),
            Packing::Flat => Ok(plan_rows::<FlatRow>(rollouts, budget, ranks)?.packed()),
        }
    }
}

/// A row being filled by the planner: a prefix tree or a flat row.
pub trait RowBuilder: Sized {
    /// Whether rollouts in one row share tokens. A row that cannot share forwards every rollout
    /// whole, so choosing among open rows gains nothing: the planner then fills rows in input
    /// order (next fit), which keeps the rows' order the rollouts' own.
    const SHARES_TOKENS: bool;
    /// A row with no rollout.
    fn empty() -> Self;
    /// Whether adding `rollout` keeps the row within `budget` forwarded and `budget` trained tokens.
    fn fits(&self, rollout: &Rollout, budget: usize) -> bool;
    /// Tokens `rollout` would add to the row.
    fn novel_tokens(&self, rollout: &Rollout) -> usize;
    /// Whether a rollout of `group` is in the row.
    fn holds_group(&self, group: &str) -> bool;
    /// Adds a rollout (validated; `row` names it in errors).
    fn add(&mut self, rollout: Rollout, row: usize) -> Result<(), PackError>;
    /// Attention load (keys attended over, summed over tokens): what rank balancing equalises.
    fn load(&self) -> u64;
    /// The packed row.
    fn pack(&self) -> PackedRow;
    /// The rollouts added, in order.
    fn rollouts(&self) -> &[Rollout];
    /// For each rollout added, the `row` it was added under (the planner passes the rollout's
    /// index in its input): where a packed row's `segment_id`s come from.
    fn sources(&self) -> &[usize];
}

/// Rows per data-parallel rank, ready to pack.
#[derive(Debug, Clone)]
pub struct PackPlan<R = PrefixTree> {
    /// `ranks[r]` = the rows rank `r` forwards, in order.
    pub ranks: Vec<Vec<R>>,
}

impl<R: RowBuilder> PackPlan<R> {
    /// All rows, rank by rank.
    pub fn rows(&self) -> impl Iterator<Item = &R> {
        self.ranks.iter().flatten()
    }

    /// Every rank's packed rows.
    pub fn packed(&self) -> Vec<Vec<PackedRow>> {
        self.ranks
            .iter()
            .map(|rows| rows.iter().map(R::pack).collect())
            .collect()
    }
}

/// [`plan_rows`] into prefix trees.
pub fn plan(rollouts: Vec<Rollout>, budget: usize, ranks: usize) -> Result<PackPlan, PackError> {
    plan_rows(rollouts, budget, ranks)
}

/// Fills micro-batch rows under a token budget (counted on *unique* tokens for trees, and on
/// trained tokens, so rows of identical rollouts still close), then spreads rows over `ranks` by
/// attention load (longest first, each to the least-loaded rank).
///
/// A rollout goes to a row already holding its group (its prompt is there), else to the row
/// where it adds the fewest new tokens, else to a new row (rows that cannot share tokens: the
/// last row if it fits, else a new one). A rollout larger than the budget is
/// an error naming it.
pub fn plan_rows<R: RowBuilder>(rollouts: Vec<Rollout>, budget: usize, ranks: usize) -> Result<PackPlan<R>, PackError> {
    if budget == 0 {
        return Err(PackError::Zero("budget"));
    }
    if ranks == 0 {
        return Err(PackError::Zero("ranks"));
    }
    let mut rows: Vec<R> = Vec::new();
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
            .position(|t| t.holds_group(&r.group_id) && t.fits(&r, budget));
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
                rows.push(R::empty());
                rows.len() - 1
            }
        };
        rows[j].add(r, i)?;
    }
    Ok(balance(rows, ranks))
}

/// Rows spread over `ranks` by attention load; within a rank, rows keep their opening order.
fn balance<R: RowBuilder>(rows: Vec<R>, ranks: usize) -> PackPlan<R> {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&j| std::cmp::Reverse(rows[j].load()));
    let mut loads = vec![0u64; ranks];
    let mut placed: Vec<Vec<usize>> = vec![Vec::new(); ranks];
    for j in order {
        let r = (0..ranks).min_by_key(|&r| (loads[r], r)).unwrap_or(0);
        loads[r] += rows[j].load();
        placed[r].push(j);
    }
    let mut slots: Vec<Option<R>> = rows.into_iter().map(Some).collect();
    let ranks = placed
        .into_iter()
        .map(|mut js| {
            js.sort_unstable();
            js.into_iter().filter_map(|j| slots[j].take()).collect()
        })
        .collect();
    PackPlan { ranks }
}
