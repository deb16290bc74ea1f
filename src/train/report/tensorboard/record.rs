//! TFRecord framing, the container of TensorBoard event files: each record is its length
//! (u64, little-endian), the masked CRC-32C of those 8 bytes, the record, and the masked
//! CRC-32C of the record.

use std::io::{self, Read, Write};

/// CRC-32C with TFRecord's mask (rotated right by 15 bits, plus a constant), so that a CRC
/// stored inside checksummed data does not checksum to itself.
pub(crate) fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Writes one framed record.
pub(crate) fn write_record(out: &mut impl Write, record: &[u8]) -> io::Result<()> {
    let len = (record.len() as u64).to_le_bytes();
    out.write_all(&len)?;
    out.write_all(&masked_crc(&len).to_le_bytes())?;
    out.write_all(record)?;
    out.write_all(&masked_crc(record).to_le_bytes())
}

/// Reads every complete record of `input`, checking both checksums; a truncated last record
/// (a writer killed mid-write) ends the list, as TensorBoard's reader treats it.
pub(crate) fn read_records(input: &mut impl Read) -> io::Result<Vec<Vec<u8>>> {
    let mut bytes = Vec::new();
    input.read_to_end(&mut bytes)?;
    let mut records = Vec::new();
    let mut at = 0;
    let corrupt = |what: &str, at: usize| io::Error::new(io::ErrorKind::InvalidData, format!("{what} at byte {at}"));
    while bytes.len() - at >= 12 {
        let len_bytes = &bytes[at..at + 8];
        let crc = u32::from_le_bytes([bytes[at + 8], bytes[at + 9], bytes[at + 10], bytes[at + 11]]);
        if crc != masked_crc(len_bytes) {
            return Err(corrupt("record length checksum mismatch", at));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let start = at + 12;
        let Some(end) = start.checked_add(len).filter(|e| e + 4 <= bytes.len()) else {
            break;
        };
        let stored = u32::from_le_bytes([bytes[end], bytes[end + 1], bytes[end + 2], bytes[end + 3]]);
        if stored != masked_crc(&bytes[start..end]) {
            return Err(corrupt("record checksum mismatch", start));
        }
        records.push(bytes[start..end].to_vec());
        at = end + 4;
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_is_castagnoli_and_the_mask_is_tfrecords() {
        // RFC 3720's check value of CRC-32C over "123456789", and TensorBoard's own
        // `masked_crc32c(b"123456789")` (tensorboard 2.21, pywrap_tensorflow stub).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
    }

    #[test]
    fn records_round_trip_and_a_cut_tail_is_dropped_but_a_flipped_bit_is_not() {
        let mut file = Vec::new();
        for r in [&b"first"[..], b"", b"third record"] {
            write_record(&mut file, r).unwrap();
        }
        let read = read_records(&mut &file[..]).unwrap();
        assert_eq!(read, vec![b"first".to_vec(), vec![], b"third record".to_vec()]);
        let cut = &file[..file.len() - 3];
        assert_eq!(read_records(&mut &cut[..]).unwrap().len(), 2);
        let mut flipped = file.clone();
        flipped[13] ^= 1;
        assert!(read_records(&mut &flipped[..]).is_err());
    }
}
