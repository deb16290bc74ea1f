//! The shipped multi-turn task: the shipped questions with several tries. After a wrong answer
//! the user says it is wrong and names it; the model answers again. A right answer ends the
//! conversation with a reward that is lower the more tries it took; the last wrong try ends it
//! with 0. What GRPO can learn here beyond first answers: not to repeat a rejected answer.

use crate::grpo::{Conversation, EnvReply, EnvRole, Environment, extract_answer};

/// The shipped questions with up to `tries` answers (the run's `max_turns` should equal it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryGame {
    /// Answers allowed.
    pub tries: usize,
    /// Reward lost per extra try (a right first answer earns 1).
    pub cost_per_retry: f32,
}

impl Default for RetryGame {
    fn default() -> Self {
        RetryGame {
            tries: 3,
            cost_per_retry: 0.3,
        }
    }
}

impl RetryGame {
    /// The user's reply to a wrong answer.
    pub fn feedback(wrong: &str) -> String {
        format!("No, {wrong} is wrong. Try again.")
    }
}

impl Environment for RetryGame {
    fn name(&self) -> &str {
        "retry_game"
    }

    fn reply(&self, c: &Conversation) -> Result<EnvReply, String> {
        let answer = c
            .row
            .get("answer")
            .and_then(|v| v.as_str())
            .ok_or("the prompt row has no string `answer` column")?;
        let given = extract_answer(c.last_reply());
        if given == answer {
            let reward = 1.0 - self.cost_per_retry * (c.turn - 1) as f32;
            return Ok(EnvReply::Done(reward.max(0.0)));
        }
        if c.turn >= self.tries || c.last_turn {
            return Ok(EnvReply::Done(0.0));
        }
        Ok(EnvReply::Message {
            role: EnvRole::User,
            content: Self::feedback(given),
        })
    }
}

impl RetryGame {
    fn rows(&self) -> Vec<(&'static str, String)> {
        let rewards: Vec<String> = (0..self.tries)
            .map(|k| format!("{:.2}", (1.0 - self.cost_per_retry * k as f32).max(0.0)))
            .collect();
        vec![
            ("environment", self.name().to_string()),
            ("tries", self.tries.to_string()),
            ("reward by try", rewards.join(", ")),
            ("after a wrong answer", Self::feedback("<answer>")),
        ]
    }
}

impl crate::display::Rich for RetryGame {
    fn html(&self) -> String {
        crate::display::rows_card("Retry game", &self.rows())
    }
    fn text(&self) -> String {
        crate::display::rows_text(&self.rows())
    }
}

crate::display::rich_display!(RetryGame);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, Value, json};

    fn talk(row: &Map<String, Value>, messages: &[Value], turn: usize) -> Result<EnvReply, String> {
        RetryGame::default().reply(&Conversation {
            row,
            messages,
            turn,
            last_turn: false,
        })
    }

    #[test]
    fn rewards_fall_with_tries_and_wrong_answers_get_feedback() {
        let row: Map<String, Value> = serde_json::from_str(r#"{"answer": "12"}"#).unwrap();
        let said = |text: &str| {
            vec![
                json!({"role": "user", "content": "?"}),
                json!({"role": "assistant", "content": text}),
            ]
        };
        assert_eq!(talk(&row, &said("Answer: 12"), 1), Ok(EnvReply::Done(1.0)));
        assert_eq!(talk(&row, &said("Answer: 12"), 2), Ok(EnvReply::Done(0.7)));
        assert_eq!(
            talk(&row, &said("Answer: 11"), 1),
            Ok(EnvReply::Message {
                role: EnvRole::User,
                content: "No, 11 is wrong. Try again.".into()
            })
        );
        assert_eq!(talk(&row, &said("Answer: 11"), 3), Ok(EnvReply::Done(0.0)));
        let card = crate::display::Rich::html(&RetryGame::default());
        assert!(
            card.contains("1.00, 0.70, 0.40") && card.contains("No, &lt;answer&gt; is wrong."),
            "{card}"
        );
        let no_answer = Map::new();
        assert!(talk(&no_answer, &said("Answer: 1"), 1).unwrap_err().contains("answer"));
    }
}
