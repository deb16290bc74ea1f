//! The protobuf messages of a TensorBoard event file, derived by hand (no `protoc`): only the
//! fields treetrain writes or reads back, with the field numbers of TensorBoard's
//! `tensorboard/compat/proto/{event,summary,tensor,tensor_shape}.proto`. Fields a reader does
//! not know are skipped by protobuf, so TensorBoard reads these as its own.

/// `Event`: one record of an event file.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The global step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// `file_version` (the first record of a file: `brain.Event:2`).
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    /// The values of this step.
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
    /// A session boundary (`START` at a resumed run's first step purges the steps after it).
    #[prost(message, optional, tag = "7")]
    pub session_log: Option<SessionLog>,
}

/// `SessionLog`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SessionLog {
    /// `SessionStatus`: 1 = `START`.
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// `SessionLog.SessionStatus.START`.
pub(crate) const SESSION_START: i32 = 1;

/// `Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `Summary.Value`: a scalar (`simple_value`) or a tensor with its plugin's metadata.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    pub tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

/// `SummaryMetadata`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `TensorProto`, for string tensors (the text plugin's data).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TensorProto {
    /// `DataType`: 7 = `DT_STRING`.
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `DataType.DT_STRING`.
pub(crate) const DT_STRING: i32 = 7;

/// `TensorShapeProto` (no dimensions: a scalar).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TensorShape {
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<TensorDim>,
}

/// `TensorShapeProto.Dim`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TensorDim {
    #[prost(int64, tag = "1")]
    pub size: i64,
}
