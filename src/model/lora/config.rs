//! What a LoRA adapter is: its rank, scaling, dropout and the layers it wraps, as PEFT's
//! `LoraConfig` names them, and the `adapter_config.json` that carries them.

use std::path::Path;

use crate::model::ModelError;

/// Which linear layers get an adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetModules {
    /// Modules whose name equals one of these or ends with `.` + one of these (PEFT's rule for
    /// a list): `q_proj` wraps every layer's `self_attn.q_proj`.
    Names(Vec<String>),
    /// Every linear layer except the output head (PEFT's `"all-linear"`).
    AllLinear,
}

impl Default for TargetModules {
    fn default() -> Self {
        TargetModules::Names(["q_proj", "k_proj", "v_proj", "o_proj"].map(String::from).to_vec())
    }
}

impl TargetModules {
    /// Whether the module named `name` (a `state_dict` prefix such as
    /// `model.layers.0.mlp.up_proj`) is wrapped. `lm_head` is never matched by `all-linear`.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            TargetModules::AllLinear => name != "lm_head",
            TargetModules::Names(names) => names.iter().any(|t| target_matches(t, name)),
        }
    }
}

/// PEFT's rule for one listed target: the whole name or its dotted tail.
pub(crate) fn target_matches(target: &str, name: &str) -> bool {
    name == target || name.ends_with(&format!(".{target}"))
}

impl serde::Serialize for TargetModules {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            TargetModules::AllLinear => s.serialize_str("all-linear"),
            TargetModules::Names(names) => names.serialize(s),
        }
    }
}

impl<'de> serde::Deserialize<'de> for TargetModules {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(String),
            Many(Vec<String>),
        }
        match Raw::deserialize(d)? {
            Raw::One(s) if s == "all-linear" => Ok(TargetModules::AllLinear),
            Raw::One(s) => Err(serde::de::Error::custom(format!(
                "\"{s}\": a single string is a regular expression in PEFT, which treetrain does not \
                 implement; list the module names ([\"q_proj\", \"v_proj\"]) or write \"all-linear\""
            ))),
            Raw::Many(v) => Ok(TargetModules::Names(v)),
        }
    }
}

/// A LoRA adapter's settings: PEFT's `LoraConfig` fields that treetrain implements, with
/// PEFT's defaults except the targets (PEFT picks per architecture; here attention's four
/// projections). The `[lora]` table of a trainer's TOML.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank of the update `B A` (`A` `[r, in]`, `B` `[out, r]`).
    pub r: i64,
    /// Scale numerator: the update is multiplied by `lora_alpha / r` (or `/ sqrt(r)`).
    pub lora_alpha: f64,
    /// Dropout on the adapter's input while training.
    pub lora_dropout: f64,
    /// The wrapped layers.
    pub target_modules: TargetModules,
    /// rsLoRA: scale by `lora_alpha / sqrt(r)`.
    pub use_rslora: bool,
    /// A mixture's 3-d expert tensors to adapt (PEFT's `target_parameters`: a parameter's
    /// full name, `model.layers.1.mlp.experts.gate_up_proj`, or its dotted tail,
    /// `experts.down_proj`); see `lora::experts` for the layout.
    pub target_parameters: Vec<String>,
    /// Linear layers trained whole beside the adapters (their copy is saved with it).
    pub modules_to_save: Vec<String>,
    /// Seed of the initialisation of `A` and of the dropout masks.
    pub seed: u64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            r: 8,
            lora_alpha: 8.0,
            lora_dropout: 0.0,
            target_modules: TargetModules::default(),
            use_rslora: false,
            target_parameters: Vec::new(),
            modules_to_save: Vec::new(),
            seed: 0,
        }
    }
}

impl LoraConfig {
    /// The multiplier of `B A x`.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.lora_alpha / (self.r as f64).sqrt()
        } else {
            self.lora_alpha / self.r as f64
        }
    }

    /// Rank > 0, alpha finite and > 0, dropout in [0, 1), at least one target; errors name the
    /// field as `lora.<field>`.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |field: &str, value: String, reason: &str| Err(ModelError::unsupported(field, value, reason));
        if self.r <= 0 {
            return bad("lora.r", self.r.to_string(), "must be > 0");
        }
        if !(self.lora_alpha.is_finite() && self.lora_alpha > 0.0) {
            return bad("lora.lora_alpha", self.lora_alpha.to_string(), "must be finite and > 0");
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return bad("lora.lora_dropout", self.lora_dropout.to_string(), "must be in [0, 1)");
        }
        if matches!(&self.target_modules, TargetModules::Names(n) if n.is_empty()) && self.target_parameters.is_empty()
        {
            return bad(
                "lora.target_modules",
                "[]".into(),
                "names no module (and target_parameters no parameter)",
            );
        }
        if !self.target_parameters.is_empty() && self.lora_dropout != 0.0 {
            return bad(
                "lora.lora_dropout",
                self.lora_dropout.to_string(),
                "must be 0 with target_parameters (PEFT refuses dropout on expert tensors: it cannot be factored out of the fused update)",
            );
        }
        Ok(())
    }
}

/// `adapter_config.json` keys whose value must be the one given (PEFT options treetrain does
/// not implement are refused, never skipped). `null` accepts an absent key too.
const MUST_EQUAL: &[(&str, &str)] = &[
    ("peft_type", "\"LORA\""),
    ("bias", "\"none\""),
    ("use_dora", "false"),
    ("fan_in_fan_out", "false"),
    ("lora_bias", "false"),
    ("layers_to_transform", "null"),
    ("layers_pattern", "null"),
    ("rank_pattern", "{}"),
    ("alpha_pattern", "{}"),
    ("megatron_config", "null"),
    ("loftq_config", "{}"),
    ("use_qalora", "false"),
    ("layer_replication", "null"),
    ("exclude_modules", "null"),
    ("trainable_token_indices", "null"),
    ("alora_invocation_tokens", "null"),
    ("arrow_config", "null"),
];

/// Keys read into [`LoraConfig`] or recorded but without effect on the forward.
const UNDERSTOOD: &[&str] = &[
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "use_rslora",
    "modules_to_save",
    "target_parameters",
    "task_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "init_lora_weights",
    "auto_mapping",
    "peft_version",
    "corda_config",
    "eva_config",
    "lora_ga_config",
    "qalora_group_size",
    "ensure_weight_tying",
    "megatron_core",
];

/// An empty value (`null`, `[]`, `{}`, `false`) stands for "off" in PEFT's config.
fn is_off(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => true,
        serde_json::Value::Bool(b) => !b,
        serde_json::Value::Array(a) => a.is_empty(),
        serde_json::Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

impl LoraConfig {
    /// The `adapter_config.json` PEFT writes for this adapter on `base_model`.
    pub(crate) fn to_peft_json(&self, base_model: &str) -> serde_json::Value {
        let modules_to_save = match self.modules_to_save.is_empty() {
            true => serde_json::Value::Null,
            false => serde_json::json!(self.modules_to_save),
        };
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "target_modules": self.target_modules,
            "use_rslora": self.use_rslora,
            "modules_to_save": modules_to_save,
            "target_parameters": match self.target_parameters.is_empty() {
                true => serde_json::Value::Null,
                false => serde_json::json!(self.target_parameters),
            },
            "bias": "none",
            "use_dora": false,
            "fan_in_fan_out": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": null,
            "treetrain_seed": self.seed,
        })
    }

    /// Reads PEFT's `adapter_config.json`: every key either understood or at its "off" value;
    /// anything else (DoRA, a bias, per-layer ranks, an unknown option) is an error naming the
    /// field.
    pub(crate) fn from_peft_json(path: &Path) -> Result<(Self, Option<String>), ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: path.into(),
            message: e.to_string(),
        })?;
        let obj = json.as_object().ok_or_else(|| ModelError::Json {
            path: path.into(),
            message: "expected a JSON object".into(),
        })?;
        let refuse = |key: &str, v: &serde_json::Value, reason: String| ModelError::Adapter {
            place: format!("{} field `{key}`", path.display()),
            message: format!("is {v}: {reason}"),
        };
        for (key, want) in MUST_EQUAL {
            let want: serde_json::Value = serde_json::from_str(want).unwrap_or_default();
            match obj.get(*key) {
                Some(v) if v == &want || (is_off(v) && is_off(&want)) => {}
                None if *key != "peft_type" => {}
                Some(v) => return Err(refuse(key, v, format!("treetrain implements only {want}"))),
                None => return Err(refuse(key, &serde_json::Value::Null, "must be \"LORA\"".into())),
            }
        }
        if let Some(v) = obj.get("init_lora_weights")
            && !(v.is_boolean() || v == "gaussian")
        {
            // PiSSA, OLoRA, LoftQ, ... change the base weights: this adapter alone is not the
            // model it was trained as.
            return Err(refuse(
                "init_lora_weights",
                v,
                "this initialisation rewrites the base weights; convert the adapter to plain LoRA in PEFT first".into(),
            ));
        }
        for (key, v) in obj {
            let known = UNDERSTOOD.contains(&key.as_str()) || MUST_EQUAL.iter().any(|(k, _)| k == key);
            if !known && !key.starts_with("treetrain_") && !is_off(v) {
                return Err(refuse(key, v, "an option treetrain does not implement".into()));
            }
        }
        let field = |key: &str| obj.get(key).filter(|v| !v.is_null()).cloned();
        let mut cfg = LoraConfig {
            seed: obj.get("treetrain_seed").and_then(|v| v.as_u64()).unwrap_or(0),
            ..LoraConfig::default()
        };
        let parse = |key: &str, v: serde_json::Value| refuse(key, &v, "has the wrong type".into());
        if let Some(v) = field("r") {
            cfg.r = v.as_i64().ok_or_else(|| parse("r", v.clone()))?;
        }
        if let Some(v) = field("lora_alpha") {
            cfg.lora_alpha = v.as_f64().ok_or_else(|| parse("lora_alpha", v.clone()))?;
        }
        if let Some(v) = field("lora_dropout") {
            cfg.lora_dropout = v.as_f64().ok_or_else(|| parse("lora_dropout", v.clone()))?;
        }
        if let Some(v) = field("use_rslora") {
            cfg.use_rslora = v.as_bool().ok_or_else(|| parse("use_rslora", v.clone()))?;
        }
        if let Some(v) = field("target_modules") {
            cfg.target_modules =
                serde_json::from_value(v.clone()).map_err(|e| refuse("target_modules", &v, e.to_string()))?;
        }
        if let Some(v) = field("target_parameters") {
            cfg.target_parameters =
                serde_json::from_value(v.clone()).map_err(|e| refuse("target_parameters", &v, e.to_string()))?;
        }
        if let Some(v) = field("modules_to_save") {
            cfg.modules_to_save =
                serde_json::from_value(v.clone()).map_err(|e| refuse("modules_to_save", &v, e.to_string()))?;
        }
        cfg.validate()?;
        let base = obj
            .get("base_model_name_or_path")
            .and_then(|v| v.as_str())
            .map(String::from);
        Ok((cfg, base))
    }
}
