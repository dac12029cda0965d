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

/// The event files [`Events::create`] made in `dir` (`PREFIX<seconds>.hetpar.<pid>`,
/// perhaps numbered), in the order they were made; other writers' are left out.
pub fn ours(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut found: Vec<(u64, String)> = std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let (seconds, rest) = name.strip_prefix(PREFIX)?.split_once('.')?;
            rest.starts_with("hetpar.").then_some(())?;
            Some((seconds.parse().ok()?, name))
        })
        .collect();
    found.sort();
    Ok(found.into_iter().map(|(_, n)| dir.join(n)).collect())
}

impl Events {
    /// A new event file under `dir` (a resumed run adds one; TensorBoard reads them all).
    pub fn create(dir: &Path) -> std::io::Result<Events> {
        let t = now();
        let name = format!("{PREFIX}{}.hetpar.{}", t as u64, std::process::id());
        // Never over an existing file (one made in the same second by this process, whose
        // events a resumed run may be carrying): a numbered name beside it instead.
        let mut path = dir.join(&name);
        let mut file = None;
        for n in 1..100 {
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => {
                    file = Some(f);
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    path = dir.join(format!("{name}.{n}"));
                }
                Err(e) => return Err(e),
            }
        }
        let mut file = file.ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{name} and 98 numbered names beside it are taken in {}", dir.display()),
            )
        })?;
        file.write_all(&record(&event(t, 0, Some("brain.Event:2"), &[])))?;
        Ok(Events { file, path })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Copies into this file the events of `earlier` files (a resumed run's, in order) with
    /// steps before `before`, as they were written (their wall times kept): what a run
    /// resumed at step `before` keeps of its history, so no step shows twice. A file's
    /// records after one cut short or failing its CRC are left out; the number copied.
    pub fn carry(&mut self, earlier: &[PathBuf], before: usize) -> std::io::Result<usize> {
        let mut copied = 0;
        for path in earlier {
            let bytes = std::fs::read(path)?;
            for (record, data) in records(&bytes) {
                if step_of(data).is_some_and(|(step, version)| !version && step < before as u64) {
                    self.file.write_all(record)?;
                    copied += 1;
                }
            }
        }
        self.file.flush()?;
        Ok(copied)
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
            let end =
                at.checked_add(n).filter(|&e| e <= b.len()).ok_or("a field runs past the end")?;
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

/// The records of an event file's `bytes` (whole, framing included) with their events'
/// data, up to the first one cut short or failing a CRC (a run killed while writing).
fn records(bytes: &[u8]) -> Vec<(&[u8], &[u8])> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(head) = bytes.get(at..at + 12) {
        let len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        let Some(n) = usize::try_from(len).ok().filter(|n| *n <= bytes.len()) else { break };
        let (Some(data), Some(crc)) =
            (bytes.get(at + 12..at + 12 + n), bytes.get(at + 12 + n..at + 16 + n))
        else {
            break;
        };
        if masked_crc(&head[..8]).to_le_bytes() != head[8..12]
            || masked_crc(data).to_le_bytes() != crc
        {
            break;
        }
        out.push((&bytes[at..at + 16 + n], data));
        at += 16 + n;
    }
    out
}

/// An event's step, and whether it is a file's version record; `None` where its data does
/// not parse.
fn step_of(data: &[u8]) -> Option<(u64, bool)> {
    let mut step = 0;
    let mut version = false;
    for (field, v) in fields(data).ok()? {
        match field {
            2 => step = u64::from_le_bytes(v.get(..8)?.try_into().ok()?),
            3 => version = true,
            _ => {}
        }
    }
    Some((step, version))
}

/// A reader of what [`Events`] writes, for the tests: every record's CRCs checked, the
/// fields decoded.
#[cfg(test)]
mod reader {
    use super::{fields, masked_crc};

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

    /// A resumed run's file carries the earlier files' events before its step, bytes and
    /// wall times as written, and stops at a record cut short (a run killed while writing).
    #[test]
    fn a_resumed_file_carries_the_events_before_its_step() {
        let dir = tempfile::Builder::new().prefix("hetpar-tb-").tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let mut first = Events::create(&a).unwrap();
        for step in 0..4 {
            first.scalars(step, &[("loss", step as f64)]).unwrap();
        }
        let mut second = Events::create(&b).unwrap();
        for step in 4..8 {
            second.scalars(step, &[("loss", step as f64)]).unwrap();
        }
        // The second file's last record cut short.
        let cut = std::fs::read(second.path()).unwrap();
        std::fs::write(second.path(), &cut[..cut.len() - 3]).unwrap();
        let mut resumed = Events::create(dir.path()).unwrap();
        let copied = resumed.carry(&[first.path().into(), second.path().into()], 6).unwrap();
        assert_eq!(copied, 6);
        let events = read(&std::fs::read(resumed.path()).unwrap()).unwrap();
        let steps: Vec<i64> = events.iter().skip(1).map(|e| e.step).collect();
        assert_eq!(steps, [0, 1, 2, 3, 4, 5]);
        let old = read(&std::fs::read(first.path()).unwrap()).unwrap();
        assert_eq!(events[1..5], old[1..5]);
        // Steps past the cut: the whole of the first file, the second's up to the cut.
        let mut all = Events::create(&a).unwrap();
        assert_eq!(all.carry(&[first.path().into(), second.path().into()], 100).unwrap(), 7);
    }
}
