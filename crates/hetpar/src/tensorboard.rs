//! TensorBoard event files, written here: `OUT/events.out.tfevents.<seconds>.hetpar.<pid>`, read
//! by `tensorboard --logdir OUT` and `wandb sync`. Each record is TFRecord framing (the
//! length as a little-endian u64, its masked CRC-32C, the bytes, their masked CRC-32C)
//! around a serialized `tensorflow.Event` protobuf: the first holds `file_version =
//! "brain.Event:2"`, each after it a step's scalars as `Summary.Value { tag, simple_value }`.
//! The few protobuf fields are encoded by hand; a reader in the tests decodes them back,
//! checking every CRC, so the tests read what was written.

use std::io::Write;
use std::path::{Path, PathBuf};

/// A CRC-32C masked the TFRecord way (rotated, plus a constant), so a CRC of data that holds
/// CRCs stays well spread.
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u64, data: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// One `Event`: wall time, step, and either the file version or a summary of scalars.
fn event(wall_time: f64, step: i64, version: Option<&str>, scalars: &[(&str, f32)]) -> Vec<u8> {
    let mut e = Vec::new();
    e.push(0x09); // field 1, 64-bit: wall_time
    e.extend_from_slice(&wall_time.to_le_bytes());
    e.push(0x10); // field 2, varint: step
    varint(&mut e, step as u64);
    if let Some(v) = version {
        bytes_field(&mut e, 3, v.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::new();
            bytes_field(&mut v, 1, tag.as_bytes());
            v.push(0x15); // field 2, 32-bit: simple_value
            v.extend_from_slice(&value.to_le_bytes());
            bytes_field(&mut summary, 1, &v);
        }
        bytes_field(&mut e, 5, &summary);
    }
    e
}

/// `data` framed as one TFRecord.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(data.len() + 16);
    r.extend_from_slice(&len);
    r.extend_from_slice(&masked_crc(&len).to_le_bytes());
    r.extend_from_slice(data);
    r.extend_from_slice(&masked_crc(data).to_le_bytes());
    r
}

/// An open event file.
pub struct Events {
    file: std::fs::File,
    path: PathBuf,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// How the name of every event file begins.
pub const PREFIX: &str = "events.out.tfevents.";

impl Events {
    /// A new event file under `dir` (a resumed run adds one; TensorBoard reads them all).
    pub fn create(dir: &Path) -> std::io::Result<Events> {
        let t = now();
        let path = dir.join(format!("{PREFIX}{}.hetpar.{}", t as u64, std::process::id()));
        let mut file = std::fs::File::create(&path)?;
        file.write_all(&record(&event(t, 0, Some("brain.Event:2"), &[])))?;
        Ok(Events { file, path })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Scalars of `step` (non-finite values are left out: TensorBoard would plot them as
    /// gaps anyway, and `metrics.jsonl` names them).
    pub fn scalars(&mut self, step: usize, scalars: &[(&str, f64)]) -> std::io::Result<()> {
        let finite: Vec<(&str, f32)> =
            scalars.iter().filter(|(_, v)| v.is_finite()).map(|&(k, v)| (k, v as f32)).collect();
        self.file.write_all(&record(&event(now(), step as i64, None, &finite)))?;
        self.file.flush()
    }
}

/// A reader of what [`Events`] writes, for the tests: every record's CRCs checked, the
/// fields decoded.
#[cfg(test)]
mod reader {
    use super::masked_crc;

    /// What [`read`] finds in one event.
    #[derive(Debug, PartialEq)]
    pub struct Read {
        /// The step.
        pub step: i64,
        /// `file_version`, on the first event.
        pub version: Option<String>,
        /// Scalars by tag.
        pub scalars: Vec<(String, f32)>,
    }

    fn read_varint(b: &[u8], at: &mut usize) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *b.get(*at).ok_or("a varint runs past the end")?;
            *at += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Ok(v);
            }
        }
        Err("a varint longer than 10 bytes".into())
    }

    /// The fields of one protobuf message: (field, wire type, payload bytes or value).
    fn fields(b: &[u8]) -> Result<Vec<(u64, Vec<u8>)>, String> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < b.len() {
            let key = read_varint(b, &mut at)?;
            let (field, wire) = (key >> 3, key & 7);
            let take = |at: &mut usize, n: usize| -> Result<Vec<u8>, String> {
                let end = at
                    .checked_add(n)
                    .filter(|&e| e <= b.len())
                    .ok_or("a field runs past the end")?;
                let v = b[*at..end].to_vec();
                *at = end;
                Ok(v)
            };
            let value = match wire {
                0 => read_varint(b, &mut at)?.to_le_bytes().to_vec(),
                1 => take(&mut at, 8)?,
                2 => {
                    let n = read_varint(b, &mut at)? as usize;
                    take(&mut at, n)?
                }
                5 => take(&mut at, 4)?,
                w => return Err(format!("wire type {w}")),
            };
            out.push((field, value));
        }
        Ok(out)
    }

    /// Every event of an event file, each record's CRCs checked.
    pub fn read(bytes: &[u8]) -> Result<Vec<Read>, String> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let head = bytes.get(at..at + 12).ok_or("a truncated record header")?;
            let len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
            if masked_crc(&head[..8]).to_le_bytes() != head[8..12] {
                return Err(format!("record at byte {at}: its length's CRC does not match"));
            }
            let n = usize::try_from(len).map_err(|_| "a record too long")?;
            let data = bytes.get(at + 12..at + 12 + n).ok_or("a truncated record")?;
            let crc = bytes.get(at + 12 + n..at + 16 + n).ok_or("a record without its CRC")?;
            if masked_crc(data).to_le_bytes() != crc {
                return Err(format!("record at byte {at}: its data's CRC does not match"));
            }
            at += 16 + n;
            let mut ev = Read { step: 0, version: None, scalars: Vec::new() };
            for (field, v) in fields(data)? {
                match field {
                    2 => ev.step = i64::from_le_bytes(v[..8].try_into().map_err(|_| "step")?),
                    3 => ev.version = Some(String::from_utf8_lossy(&v).into_owned()),
                    5 => {
                        for (f, value) in fields(&v)? {
                            if f != 1 {
                                continue;
                            }
                            let (mut tag, mut x) = (String::new(), f32::NAN);
                            for (g, w) in fields(&value)? {
                                match g {
                                    1 => tag = String::from_utf8_lossy(&w).into_owned(),
                                    2 => {
                                        x = f32::from_le_bytes(
                                            w[..4].try_into().map_err(|_| "value")?,
                                        )
                                    }
                                    _ => {}
                                }
                            }
                            ev.scalars.push((tag, x));
                        }
                    }
                    _ => {}
                }
            }
            out.push(ev);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::Events;
    use super::reader::read;

    #[test]
    fn crc32c_is_castagnolis() {
        // The standard check value of CRC-32C.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn an_event_file_reads_back_with_its_version_steps_and_scalars() {
        let dir = tempfile::Builder::new().prefix("hetpar-tb-").tempdir().unwrap();
        let mut e = Events::create(dir.path()).unwrap();
        e.scalars(0, &[("loss", 6.25), ("lr", 3e-4), ("mfu", f64::NAN)]).unwrap();
        e.scalars(300, &[("heldout/loss", 1.5)]).unwrap();
        let bytes = std::fs::read(e.path()).unwrap();
        let events = read(&bytes).unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].version.as_deref(), Some("brain.Event:2"));
        assert_eq!(events[1].step, 0);
        assert_eq!(events[1].scalars, vec![("loss".into(), 6.25), ("lr".into(), 3e-4f32)]);
        assert_eq!((events[2].step, events[2].scalars[0].1), (300, 1.5));
        // A flipped byte is caught by the CRC.
        let mut bad = bytes.clone();
        let n = bad.len();
        bad[n - 6] ^= 1;
        assert!(read(&bad).unwrap_err().contains("CRC"));
    }
}
