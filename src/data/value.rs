//! Arrow values to JSON, for every type Hugging Face datasets write in text columns.

use arrow::array::{Array, ArrayRef, AsArray};
use arrow::datatypes::{
    DataType, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type,
    UInt64Type,
};
use serde_json::Value;

/// Row `i` of `array` as JSON: strings (plain, large, view), integers, floats, bools, nulls,
/// lists (plain, large, fixed-size, view) and structs, nested to any depth. Other types (dates,
/// binaries...) come back as `None` so the caller can name the column.
pub fn to_json(array: &ArrayRef, i: usize) -> Option<Value> {
    if array.is_null(i) {
        return Some(Value::Null);
    }
    macro_rules! num {
        ($t:ty) => {
            Some(Value::from(array.as_primitive::<$t>().value(i)))
        };
    }
    match array.data_type() {
        DataType::Null => Some(Value::Null),
        DataType::Boolean => Some(Value::Bool(array.as_boolean().value(i))),
        DataType::Utf8 => Some(Value::String(array.as_string::<i32>().value(i).to_string())),
        DataType::LargeUtf8 => Some(Value::String(array.as_string::<i64>().value(i).to_string())),
        DataType::Utf8View => Some(Value::String(array.as_string_view().value(i).to_string())),
        DataType::Int8 => num!(Int8Type),
        DataType::Int16 => num!(Int16Type),
        DataType::Int32 => num!(Int32Type),
        DataType::Int64 => num!(Int64Type),
        DataType::UInt8 => num!(UInt8Type),
        DataType::UInt16 => num!(UInt16Type),
        DataType::UInt32 => num!(UInt32Type),
        DataType::UInt64 => num!(UInt64Type),
        DataType::Float32 => num!(Float32Type),
        DataType::Float64 => num!(Float64Type),
        DataType::List(_) => list(&array.as_list::<i32>().value(i)),
        DataType::LargeList(_) => list(&array.as_list::<i64>().value(i)),
        DataType::FixedSizeList(..) => list(&array.as_fixed_size_list().value(i)),
        DataType::ListView(_) => list(&array.as_list_view::<i32>().value(i)),
        DataType::LargeListView(_) => list(&array.as_list_view::<i64>().value(i)),
        DataType::Struct(fields) => {
            let s = array.as_struct();
            let mut map = serde_json::Map::new();
            for (f, col) in fields.iter().zip(s.columns()) {
                map.insert(f.name().clone(), to_json(col, i)?);
            }
            Some(Value::Object(map))
        }
        _ => None,
    }
}

fn list(values: &ArrayRef) -> Option<Value> {
    (0..values.len())
        .map(|j| to_json(values, j))
        .collect::<Option<Vec<_>>>()
        .map(Value::Array)
}
