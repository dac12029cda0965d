//! Module weights in safetensors files with HF names: the full (unsharded) tensors of one
//! module per file. Saving gathers every rank's slices on the module's first rank; loading
//! reads, on each rank, only the bytes of its own slices (the header, then one contiguous
//! run per outer index of the split dimension). Every size and offset read from the file is
//! checked against the file's length before use; nothing executable is ever loaded.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use hetpar_comm::{CommExt, Communicator};
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{NnError, Result};
use crate::params::{Param, ShardSpec, Split};

/// A tensor entry of a safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Element type (`F32`, `F64`, `BF16`).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte range in the data section.
    pub begin: u64,
    /// End of the byte range.
    pub end: u64,
}

fn bad(path: &Path, what: impl std::fmt::Display) -> NnError {
    NnError::Input(format!("{}: {what}", path.display()))
}

/// A safetensors file written tensor by tensor, hashed as it is written: the header first
/// (from every tensor's name, element type and shape), then each tensor's bytes in the
/// file's order ([`file_order`]), so no more than one tensor need be in memory. The file is
/// the one `safetensors::serialize` would make from the same tensors, byte for byte.
#[allow(missing_debug_implementations)] // holds a hasher and a buffered file
pub struct Writer {
    path: PathBuf,
    out: BufWriter<File>,
    hash: Sha256,
    /// Bytes the data section holds.
    data: u64,
    /// Data bytes written so far.
    written: u64,
    /// Bytes of the whole file so far.
    total: u64,
    tensors: Vec<String>,
}

/// What a [`Writer`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    /// SHA-256 of the file's bytes, lower-case hex.
    pub sha256: String,
    /// Its length.
    pub bytes: u64,
    /// Its tensors, in name order.
    pub tensors: Vec<String>,
}

/// One tensor of a file to write: name, element type, shape.
pub type Planned = (String, Dtype, Vec<usize>);

/// The order of tensors in a safetensors file, as the safetensors crate writes them: by
/// element alignment, widest first, then by name.
pub fn file_order(a: &Planned, b: &Planned) -> std::cmp::Ordering {
    b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0))
}

/// Bytes per element of the types saved here (all whole bytes).
fn elem_bytes(dtype: Dtype) -> usize {
    dtype.bitsize() / 8
}

fn byte_len(dtype: Dtype, shape: &[usize]) -> u64 {
    shape.iter().product::<usize>() as u64 * elem_bytes(dtype) as u64
}

impl Writer {
    /// Creates `path` (truncating a file there) and writes the header of `tensors`.
    pub fn create(path: &Path, tensors: &[Planned]) -> Result<Writer> {
        let mut order = tensors.to_vec();
        order.sort_by(file_order);
        let mut at = 0usize;
        let mut infos = Vec::with_capacity(order.len());
        for (name, dtype, shape) in &order {
            let n = byte_len(*dtype, shape) as usize;
            infos.push((
                name.clone(),
                TensorInfo { dtype: *dtype, shape: shape.clone(), data_offsets: (at, at + n) },
            ));
            at += n;
        }
        let meta = Metadata::new(None, infos).map_err(|e| bad(path, e))?;
        let mut header = serde_json::to_vec(&meta).map_err(|e| bad(path, e))?;
        header.resize(header.len().next_multiple_of(8), b' ');
        if header.len() > MAX_HEADER {
            return Err(bad(path, format!("a header of {} bytes is too large", header.len())));
        }
        let file = File::create(path).map_err(|e| bad(path, e))?;
        let mut w = Writer {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(1 << 20, file),
            hash: Sha256::new(),
            data: at as u64,
            written: 0,
            total: 0,
            tensors: order.into_iter().map(|t| t.0).collect(),
        };
        w.tensors.sort();
        w.put(&(header.len() as u64).to_le_bytes())?;
        w.put(&header)?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.out.write_all(bytes).map_err(|e| bad(&self.path, e))?;
        self.hash.update(bytes);
        self.total += bytes.len() as u64;
        Ok(())
    }

    /// Appends `bytes` to the data: the tensors' little-endian values, in the file's order.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        if self.written + bytes.len() as u64 > self.data {
            return Err(bad(
                &self.path,
                format!(
                    "{} more bytes after {} of a data section of {}",
                    bytes.len(),
                    self.written,
                    self.data
                ),
            ));
        }
        self.written += bytes.len() as u64;
        self.put(bytes)
    }

    /// Checks every tensor was written, flushes and fsyncs the file.
    pub fn finish(self) -> Result<Written> {
        let Writer { path, out, hash, data, written, total, tensors } = self;
        if written != data {
            return Err(bad(&path, format!("{written} bytes written of {data}")));
        }
        let file = out.into_inner().map_err(|e| bad(&path, e.error()))?;
        file.sync_all().map_err(|e| bad(&path, e))?;
        Ok(Written { sha256: format!("{:x}", hash.finalize()), bytes: total, tensors })
    }
}

/// The largest header [`read_header`] reads.
const MAX_HEADER: usize = 100 << 20;

/// A tensor's values as little-endian bytes (the layout safetensors stores).
enum Host {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bf16(Vec<half::bf16>),
}

// Tensors go to disk and over the wire as their in-memory bytes, which safetensors requires
// little-endian.
const _: () = assert!(cfg!(target_endian = "little"), "safetensors files are little-endian");

impl Host {
    fn of(t: &Tensor) -> Result<Host> {
        let t = t.flatten_all()?;
        Ok(match t.dtype() {
            DType::F32 => Host::F32(t.to_vec1()?),
            DType::F64 => Host::F64(t.to_vec1()?),
            DType::BF16 => Host::Bf16(t.to_vec1()?),
            other => {
                return Err(NnError::Input(format!("saving {other:?} tensors is not supported")));
            }
        })
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Host::F32(v) => bytemuck::cast_slice(v),
            Host::F64(v) => bytemuck::cast_slice(v),
            Host::Bf16(v) => bytemuck::cast_slice(v),
        }
    }
}

/// The safetensors type of a header's (or candle's debug) name: the three kinds files here
/// hold.
fn named(dtype: &str) -> Option<Dtype> {
    match dtype {
        "F32" => Some(Dtype::F32),
        "F64" => Some(Dtype::F64),
        "BF16" => Some(Dtype::BF16),
        _ => None,
    }
}

/// The safetensors type tensor `name` of `t` is saved as, in file `path`.
fn saved_type(path: &Path, name: &str, t: &Tensor) -> Result<Dtype> {
    named(&format!("{:?}", t.dtype()))
        .ok_or_else(|| bad(path, format!("{name}: saving {:?} is not supported", t.dtype())))
}

/// Writes `tensors` (full; f32, f64 or bf16) to `path`, one at a time; on failure what was
/// at `path` stays as it was.
pub fn save(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<Written> {
    let mut plan = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        plan.push((name.clone(), saved_type(path, name, t)?, t.dims().to_vec()));
    }
    replace(path, |tmp| {
        let mut w = Writer::create(tmp, &plan)?;
        plan.sort_by(file_order);
        for (name, _, _) in &plan {
            w.write(Host::of(&tensors[name])?.bytes())?;
        }
        w.finish()
    })
}

/// Writes `path` through `write`, into a temporary file beside it that replaces it once
/// written and fsynced: a failure leaves what was at `path` as it was, and no temporary
/// file. The file gets the mode a plain create gives.
fn replace(path: &Path, write: impl FnOnce(&Path) -> Result<Written>) -> Result<Written> {
    let name = path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let written = write(&tmp).and_then(|w| {
        std::fs::rename(&tmp, path).map_err(|e| bad(path, e))?;
        // The rename itself made durable, as the file's bytes were.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir).and_then(|d| d.sync_all()).map_err(|e| bad(dir, e))?;
        }
        Ok(w)
    });
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        // Errors name the file asked for, not the temporary one.
        match e {
            NnError::Input(m) => {
                NnError::Input(m.replace(&tmp.display().to_string(), &path.display().to_string()))
            }
            other => other,
        }
    })
}

/// One tensor [`copy_tensors`] copies: tensor `name` of safetensors file `file`, written
/// under the name `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source<'a> {
    /// The file holding it.
    pub file: &'a Path,
    /// Its name there.
    pub name: &'a str,
    /// Its name in the file written.
    pub to: &'a str,
}

impl<'a> Source<'a> {
    /// Tensor `name` of `file`, under the same name.
    pub fn same(file: &'a Path, name: &'a str) -> Source<'a> {
        Source { file, name, to: name }
    }
}

/// Where a tensor [`copy_tensors`] writes comes from.
enum Origin<'a> {
    /// A byte range of a file.
    File(&'a Path, u64, u64),
    /// A tensor in memory.
    Made(&'a Tensor),
}

/// Writes tensors of safetensors files into one file `out` by copying their bytes, a
/// mebibyte at a time (each file's header checked as [`read_header`] does), with the
/// tensors of `made` (f32, f64 or bf16) beside them. On failure what was at `out` stays
/// as it was.
pub fn copy_tensors(
    out: &Path,
    from: &[Source<'_>],
    made: &BTreeMap<String, Tensor>,
) -> Result<Written> {
    let mut headers: BTreeMap<&Path, (u64, BTreeMap<String, Entry>)> = BTreeMap::new();
    let mut plan = Vec::with_capacity(from.len() + made.len());
    let mut origin: BTreeMap<&str, Origin<'_>> = BTreeMap::new();
    let twice = |name: &str| bad(out, format!("tensor {name} is asked for twice"));
    for s in from {
        if !headers.contains_key(s.file) {
            headers.insert(s.file, read_header(s.file)?);
        }
        let (start, entries) = &headers[s.file];
        let e = entries
            .get(s.name)
            .ok_or_else(|| bad(s.file, format!("no tensor named {}", s.name)))?;
        let dtype = named(&e.dtype).expect("read_header admits only named types");
        let at = Origin::File(s.file, start + e.begin, e.end - e.begin);
        if origin.insert(s.to, at).is_some() {
            return Err(twice(s.to));
        }
        plan.push((s.to.to_string(), dtype, e.shape.clone()));
    }
    for (name, t) in made {
        if origin.insert(name, Origin::Made(t)).is_some() {
            return Err(twice(name));
        }
        plan.push((name.clone(), saved_type(out, name, t)?, t.dims().to_vec()));
    }
    replace(out, |tmp| {
        let mut w = Writer::create(tmp, &plan)?;
        plan.sort_by(file_order);
        let mut buf = vec![0u8; 1 << 20];
        for (name, _, _) in &plan {
            let (path, at, mut left) = match origin[name.as_str()] {
                Origin::File(path, at, len) => (path, at, len),
                Origin::Made(t) => {
                    w.write(Host::of(t)?.bytes())?;
                    continue;
                }
            };
            let mut f = File::open(path).map_err(|e| bad(path, e))?;
            f.seek(SeekFrom::Start(at)).map_err(|e| bad(path, e))?;
            while left > 0 {
                let k = left.min(buf.len() as u64) as usize;
                f.read_exact(&mut buf[..k]).map_err(|e| bad(path, format!("{name}: {e}")))?;
                w.write(&buf[..k])?;
                left -= k as u64;
            }
        }
        w.finish()
    })
}

/// Parses the header of `path`: the offset where data starts and every entry, checked
/// against the file length.
pub fn read_header(path: &Path) -> Result<(u64, BTreeMap<String, Entry>)> {
    let mut f = File::open(path).map_err(|e| bad(path, e))?;
    let len = f.metadata().map_err(|e| bad(path, e))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| bad(path, "too short for a safetensors header"))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER as u64 || 8 + n > len {
        return Err(bad(path, format!("header of {n} bytes does not fit a file of {len} bytes")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|e| bad(path, e))?;
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| bad(path, format!("header is not JSON: {e}")))?;
    let data_start = 8 + n;
    let mut out = BTreeMap::new();
    for (name, v) in json {
        if name == "__metadata__" {
            continue;
        }
        let field = |k: &str| {
            v.get(k).ok_or_else(|| bad(path, format!("{name}: header entry lacks `{k}`")))
        };
        let dtype = field("dtype")?
            .as_str()
            .ok_or_else(|| bad(path, format!("{name}: dtype is not a string")))?
            .to_string();
        let nums = |k: &str| -> Result<Vec<u64>> {
            field(k)?
                .as_array()
                .and_then(|a| a.iter().map(serde_json::Value::as_u64).collect::<Option<Vec<u64>>>())
                .ok_or_else(|| bad(path, format!("{name}: `{k}` is not a list of sizes")))
        };
        let shape: Vec<usize> = nums("shape")?.into_iter().map(|x| x as usize).collect();
        let offsets = nums("data_offsets")?;
        let (begin, end) = match offsets[..] {
            [b, e] if b <= e => (b, e),
            _ => return Err(bad(path, format!("{name}: bad data_offsets {offsets:?}"))),
        };
        let elem = match named(&dtype) {
            Some(d) => elem_bytes(d) as u64,
            None => return Err(bad(path, format!("{name}: unsupported dtype {dtype}"))),
        };
        // Checked sums and products: a crafted header's sizes near 2^64 must not wrap past
        // the bounds check (release builds do not trap on overflow).
        let Some(want) = shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
            .and_then(|n| n.checked_mul(elem))
            .filter(|&n| usize::try_from(n).is_ok())
        else {
            return Err(bad(path, format!("{name}: shape {shape:?} of {dtype} is too large")));
        };
        if end - begin != want || data_start.checked_add(end).is_none_or(|e| e > len) {
            return Err(bad(
                path,
                format!(
                    "{name}: {} bytes at {begin}..{end} for shape {shape:?} of {dtype} ({want} bytes), file has {} data bytes",
                    end - begin,
                    len - data_start
                ),
            ));
        }
        out.insert(name, Entry { dtype, shape, begin, end });
    }
    // No two tensors may share bytes (the format's rule): a crafted header could otherwise
    // read one tensor's values as another's, a weight as its optimizer moment say.
    let mut ranges: Vec<(&String, &Entry)> = out.iter().filter(|(_, e)| e.end > e.begin).collect();
    ranges.sort_by_key(|(_, e)| e.begin);
    for pair in ranges.windows(2) {
        let [(a, x), (b, y)] = pair else { unreachable!("windows of two") };
        if y.begin < x.end {
            return Err(bad(
                path,
                format!(
                    "{b}: bytes {}..{} overlap {a}'s {}..{} (tensors may not share bytes)",
                    y.begin, y.end, x.begin, x.end
                ),
            ));
        }
    }
    Ok((data_start, out))
}

/// A safetensors file open for slices: its header parsed once, every slice read by
/// position, so a caller loading many tensors from one file reads and parses the header
/// once rather than per tensor.
#[derive(Debug)]
pub struct Reader {
    path: PathBuf,
    file: File,
    data_start: u64,
    entries: BTreeMap<String, Entry>,
}

impl Reader {
    /// Opens `path` and checks its header ([`read_header`]).
    pub fn open(path: &Path) -> Result<Reader> {
        let (data_start, entries) = read_header(path)?;
        let file = File::open(path).map_err(|e| bad(path, e))?;
        Ok(Reader { path: path.to_path_buf(), file, data_start, entries })
    }

    /// Whether the file holds a tensor named `name`.
    pub fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Reads the slice `spec` of tensor `name`, touching only its bytes. Returns the tensor
    /// (in `dtype`) and the bytes read.
    pub fn slice(&self, name: &str, spec: &ShardSpec, dtype: DType) -> Result<(Tensor, u64)> {
        use std::os::unix::fs::FileExt;
        let path = self.path.as_path();
        let e =
            self.entries.get(name).ok_or_else(|| bad(path, format!("no tensor named {name}")))?;
        if e.shape != spec.global_shape {
            return Err(bad(
                path,
                format!(
                    "{name} has shape {:?}, the model expects {:?}",
                    e.shape, spec.global_shape
                ),
            ));
        }
        let st = named(&e.dtype).expect("read_header admits only named types");
        let elem = elem_bytes(st) as u64;
        let shape = &e.shape;
        let (dim, offset, len) = match spec.split {
            Some(Split { dim, offset, len }) => (dim, offset, len),
            None => (0, 0, shape.first().copied().unwrap_or(1)),
        };
        let outer: usize = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        let full = shape.get(dim).copied().unwrap_or(1);
        let mut raw = vec![0u8; outer * len * inner * elem as usize];
        let run = len * inner * elem as usize;
        for o in 0..outer {
            let at = self.data_start + e.begin + ((o * full + offset) * inner) as u64 * elem;
            self.file
                .read_exact_at(&mut raw[o * run..(o + 1) * run], at)
                .map_err(|err| bad(path, format!("{name}: {err}")))?;
        }
        let mut local_shape = shape.clone();
        if !local_shape.is_empty() {
            local_shape[dim] = len;
        }
        let t = from_le(&raw, st, local_shape)?;
        Ok((t.to_dtype(dtype)?, raw.len() as u64))
    }
}

/// A tensor from its little-endian bytes, of safetensors type `dtype` (`F32`, `F64` or
/// `BF16`, as [`read_header`] admits them).
fn from_le(raw: &[u8], dtype: Dtype, shape: Vec<usize>) -> Result<Tensor> {
    Ok(match dtype {
        Dtype::F32 => Tensor::from_vec(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect::<Vec<_>>(),
            shape,
            &Device::Cpu,
        )?,
        Dtype::F64 => Tensor::from_vec(
            raw.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect::<Vec<_>>(),
            shape,
            &Device::Cpu,
        )?,
        _ => Tensor::from_vec(
            raw.chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                .collect::<Vec<_>>(),
            shape,
            &Device::Cpu,
        )?,
    })
}

/// Loads every parameter's slice from `path` into the parameters; returns the bytes read.
pub fn load_params(path: &Path, params: &[&Param]) -> Result<u64> {
    let file = Reader::open(path)?;
    let mut read = 0;
    for p in params {
        let (t, n) = file.slice(&p.name, &p.spec, p.tensor().dtype())?;
        p.var.set(&t)?;
        read += n;
    }
    Ok(read)
}

/// A slice one rank holds, as every member of the group learns it.
#[derive(Serialize, Deserialize)]
struct Held {
    name: String,
    dtype: String,
    shape: Vec<usize>,
    /// `[dim, offset, len]` of its split.
    split: Option<[usize; 3]>,
    /// The dimensions of the tensor it holds.
    local: Vec<usize>,
}

/// One full tensor of a sharded save, and the slices that make it.
#[derive(Clone, Debug)]
struct Whole {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    /// The split dimension (0 when the tensor is not split).
    dim: usize,
    /// `(member, offset, len)` along `dim`, by offset, tiling it: each slice sent by the
    /// first member holding it (one replica's copy; the others send nothing).
    pieces: Vec<(usize, usize, usize)>,
}

impl Whole {
    fn planned(&self) -> Planned {
        (self.name.clone(), self.dtype, self.shape.clone())
    }
}

/// The full tensors of `params` across a group: every member's slices gathered (one
/// all-gather of names and shapes) into the same plan on every member, or the same error
/// (members disagreeing on a tensor's shape or type, slices that do not tile it).
fn plan_wholes(comm: Option<&dyn Communicator>, params: &[&Param]) -> Result<Vec<Whole>> {
    let mine: Vec<Held> = params
        .iter()
        .map(|p| Held {
            name: p.name.clone(),
            dtype: format!("{:?}", p.tensor().dtype()),
            shape: p.spec.global_shape.clone(),
            split: p.spec.split.map(|s| [s.dim, s.offset, s.len]),
            local: p.tensor().dims().to_vec(),
        })
        .collect();
    let all: Vec<Vec<Held>> = match comm {
        Some(c) => {
            let text = serde_json::to_vec(&mine).map_err(|e| NnError::Input(e.to_string()))?;
            c.all_gather_any(&text)?
                .iter()
                .map(|t| serde_json::from_slice(t).map_err(|e| NnError::Input(e.to_string())))
                .collect::<Result<_>>()?
        }
        None => vec![mine],
    };
    let mut by_name: BTreeMap<&str, Vec<(usize, &Held)>> = BTreeMap::new();
    for (member, held) in all.iter().enumerate() {
        for h in held {
            let mut slice = h.shape.clone();
            if let Some([dim, _, len]) = h.split
                && let Some(d) = slice.get_mut(dim)
            {
                *d = len;
            }
            if h.local != slice {
                return Err(NnError::Input(format!(
                    "{}: member {member} holds a tensor of shape {:?} for its slice of shape {slice:?}",
                    h.name, h.local
                )));
            }
            by_name.entry(h.name.as_str()).or_default().push((member, h));
        }
    }
    let mut wholes = Vec::with_capacity(by_name.len());
    for (name, holders) in by_name {
        let first = holders[0].1;
        if let Some((m, h)) =
            holders.iter().find(|(_, h)| h.shape != first.shape || h.dtype != first.dtype)
        {
            return Err(NnError::Input(format!(
                "{name}: member {} holds it as {} {:?}, member {m} as {} {:?}",
                holders[0].0, first.dtype, first.shape, h.dtype, h.shape
            )));
        }
        let dtype = named(&first.dtype).ok_or_else(|| {
            NnError::Input(format!("{name}: saving {} tensors is not supported", first.dtype))
        })?;
        let full_len = first.shape.first().copied().unwrap_or(1);
        let (dim, pieces) = match holders.iter().find(|(_, h)| h.split.is_none()) {
            Some(&(m, _)) => (0, vec![(m, 0, full_len)]),
            None => {
                let dim = first.split.map_or(0, |s| s[0]);
                let mut pieces: Vec<(usize, usize, usize)> = Vec::new();
                for (m, h) in &holders {
                    let [d, offset, len] = h.split.unwrap_or_default();
                    if d != dim {
                        return Err(NnError::Input(format!(
                            "{name}: members split it on dimensions {dim} and {d}"
                        )));
                    }
                    if !pieces.iter().any(|p| p.1 == offset && p.2 == len) {
                        pieces.push((*m, offset, len));
                    }
                }
                pieces.sort_by_key(|p| p.1);
                let full = first.shape.get(dim).copied().unwrap_or(1);
                let mut at = 0;
                for p in &pieces {
                    if p.1 != at {
                        return Err(NnError::Input(format!(
                            "{name}: the members' slices of dimension {dim} ({}) do not tile its {full}",
                            pieces
                                .iter()
                                .map(|p| format!("{}..{}", p.1, p.1 + p.2))
                                .collect::<Vec<_>>()
                                .join(", ")
                        )));
                    }
                    at += p.2;
                }
                if at != full {
                    return Err(NnError::Input(format!(
                        "{name}: the members' slices cover {at} of dimension {dim}'s {full}"
                    )));
                }
                (dim, pieces)
            }
        };
        wholes.push(Whole {
            name: name.to_string(),
            dtype,
            shape: first.shape.clone(),
            dim,
            pieces,
        });
    }
    wholes.sort_by(|a, b| file_order(&a.planned(), &b.planned()));
    Ok(wholes)
}

const SLICE_TAG: u32 = 0x5742;

/// Moves every whole tensor's slices to member 0, one tensor at a time in `wholes`' order,
/// handing member 0 each tensor's bytes in order to `emit` (`(tensor, bytes)`, one or more
/// calls per tensor). Slices split on the outer dimension pass through as they arrive;
/// others are put together in one tensor-sized buffer. After `emit` fails, member 0 still
/// takes every slice (so no member waits on a send), and returns that first error.
fn stream_wholes(
    comm: Option<&dyn Communicator>,
    params: &[&Param],
    wholes: &[Whole],
    mut emit: impl FnMut(&Whole, &[u8]) -> Result<()>,
) -> Result<()> {
    let me = comm.map_or(0, |c| c.rank());
    let local: BTreeMap<&str, &Param> = params.iter().map(|p| (p.name.as_str(), *p)).collect();
    let mut failed: Option<NnError> = None;
    for w in wholes {
        let elem = elem_bytes(w.dtype);
        let outer: usize = w.shape[..w.dim.min(w.shape.len())].iter().product();
        let inner: usize = w.shape.get(w.dim + 1..).map_or(1, |s| s.iter().product());
        let full = w.shape.get(w.dim).copied().unwrap_or(1);
        let mut assembled = if outer > 1 && failed.is_none() && me == 0 {
            vec![0u8; outer * full * inner * elem]
        } else {
            Vec::new()
        };
        for &(owner, offset, len) in &w.pieces {
            if me != 0 {
                if owner == me {
                    let host = Host::of(local[w.name.as_str()].tensor())?;
                    comm.expect("several members").send_bytes(host.bytes(), 0, SLICE_TAG)?;
                }
                continue;
            }
            let host;
            let mut received = Vec::new();
            let bytes: &[u8] = if owner == 0 {
                host = Host::of(local[w.name.as_str()].tensor())?;
                host.bytes()
            } else {
                received.resize(outer * len * inner * elem, 0);
                comm.expect("several members").recv_bytes(&mut received, owner, SLICE_TAG)?;
                &received
            };
            if failed.is_some() {
                continue;
            }
            if outer <= 1 {
                if let Err(e) = emit(w, bytes) {
                    failed = Some(e);
                }
                continue;
            }
            let (run, row) = (len * inner * elem, full * inner * elem);
            for o in 0..outer {
                let at = o * row + offset * inner * elem;
                assembled[at..at + run].copy_from_slice(&bytes[o * run..(o + 1) * run]);
            }
        }
        if outer > 1
            && failed.is_none()
            && me == 0
            && let Err(e) = emit(w, &assembled)
        {
            failed = Some(e);
        }
    }
    failed.map_or(Ok(()), Err)
}

/// Saves the full tensors of `params`, whose slices the members of `comm` hold (`None`: this
/// rank holds them whole), to `path` on member 0, streaming: one tensor in memory at a
/// time, each slice sent once (by the first member holding it, not by every replica), in
/// messages of one slice. Every member calls it; member 0 returns what it wrote (on failure
/// what was at `path` stays as it was). An error is the same on every member, except one
/// writing the file (member 0's own).
pub fn save_sharded(
    comm: Option<&dyn Communicator>,
    params: &[&Param],
    path: &Path,
) -> Result<Option<Written>> {
    let wholes = plan_wholes(comm, params)?;
    let me = comm.map_or(0, |c| c.rank());
    if me != 0 {
        return stream_wholes(comm, params, &wholes, |_, _| Ok(())).map(|()| None);
    }
    let plan: Vec<Planned> = wholes.iter().map(Whole::planned).collect();
    let mut streamed = Ok(());
    let written = replace(path, |tmp| {
        let mut writer = Writer::create(tmp, &plan);
        streamed = stream_wholes(comm, params, &wholes, |_, bytes| match writer.as_mut() {
            Ok(w) => w.write(bytes),
            // Creating the file failed: its error is returned below.
            Err(_) => Ok(()),
        });
        let w = writer?;
        streamed.as_ref().map_err(|e| NnError::Input(e.to_string()))?;
        w.finish()
    });
    // A communication error first: it is what the other members see.
    streamed?;
    written.map(Some)
}

/// Gathers every rank's slices of `params` over `comm` (the module's ranks; the same
/// parameter names on every rank that holds them) and returns the full tensors on member 0,
/// `None` on the others.
pub fn gather_full(
    comm: &dyn Communicator,
    params: &[&Param],
) -> Result<Option<BTreeMap<String, Tensor>>> {
    let wholes = plan_wholes(Some(comm), params)?;
    let mut bytes: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    stream_wholes(Some(comm), params, &wholes, |w, b| {
        bytes.entry(w.name.clone()).or_default().extend_from_slice(b);
        Ok(())
    })?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    let mut full = BTreeMap::new();
    for w in &wholes {
        let t = from_le(&bytes[&w.name], w.dtype, w.shape.clone())?;
        full.insert(w.name.clone(), t);
    }
    Ok(Some(full))
}
