//! Module weights in safetensors files with HF names: the full (unsharded) tensors of one
//! module per file. Saving gathers every rank's slices on the module's first rank; loading
//! reads, on each rank, only the bytes of its own slices (the header, then one contiguous
//! run per outer index of the split dimension). Every size and offset read from the file is
//! checked against the file's length before use; nothing executable is ever loaded.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use hetpar_comm::{CommExt, Communicator};
use safetensors::tensor::{Dtype, TensorView};

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

/// Writes `tensors` (full, f32 or f64) to `path`.
pub fn save(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let mut bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        let t = t.contiguous()?;
        let (dtype, data) = match t.dtype() {
            DType::F32 => (Dtype::F32, bytemuck_f32(&t.flatten_all()?.to_vec1::<f32>()?)),
            DType::F64 => (
                Dtype::F64,
                t.flatten_all()?.to_vec1::<f64>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
            other => return Err(bad(path, format!("{name}: saving {other:?} is not supported"))),
        };
        bytes.push((name.clone(), dtype, t.dims().to_vec(), data));
    }
    let views = bytes
        .iter()
        .map(|(n, d, s, b)| {
            Ok((n.as_str(), TensorView::new(*d, s.clone(), b).map_err(|e| bad(path, e))?))
        })
        .collect::<Result<Vec<_>>>()?;
    // safetensors writes a private temporary file (mode 0600) and renames it into place: the
    // file gets the mode a plain create gives here (or the one it had), so whoever may read
    // the directory may read what a run saved.
    let (mode, created) = match std::fs::metadata(path) {
        Ok(m) => (m.permissions(), false),
        Err(_) => {
            let f = File::create(path).and_then(|f| f.metadata()).map_err(|e| bad(path, e))?;
            (f.permissions(), true)
        }
    };
    if let Err(e) = safetensors::serialize_to_file(views, None, path) {
        if created {
            // No empty file left where the tensors were to go.
            let _ = std::fs::remove_file(path);
        }
        return Err(bad(path, e));
    }
    std::fs::set_permissions(path, mode).map_err(|e| bad(path, e))
}

fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Parses the header of `path`: the offset where data starts and every entry, checked
/// against the file length.
pub fn read_header(path: &Path) -> Result<(u64, BTreeMap<String, Entry>)> {
    let mut f = File::open(path).map_err(|e| bad(path, e))?;
    let len = f.metadata().map_err(|e| bad(path, e))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| bad(path, "too short for a safetensors header"))?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 || 8 + n > len {
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
        let elem = match dtype.as_str() {
            "F32" => 4,
            "F64" => 8,
            "BF16" => 2,
            other => return Err(bad(path, format!("{name}: unsupported dtype {other}"))),
        };
        let want = shape.iter().product::<usize>() as u64 * elem;
        if end - begin != want || data_start + end > len {
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
    Ok((data_start, out))
}

/// Reads the slice `spec` of tensor `name` from `path`, touching only its bytes. Returns the
/// tensor (in `dtype`) and the bytes read.
pub fn load_slice(
    path: &Path,
    name: &str,
    spec: &ShardSpec,
    dtype: DType,
) -> Result<(Tensor, u64)> {
    let (data_start, entries) = read_header(path)?;
    let e = entries.get(name).ok_or_else(|| bad(path, format!("no tensor named {name}")))?;
    if e.shape != spec.global_shape {
        return Err(bad(
            path,
            format!("{name} has shape {:?}, the model expects {:?}", e.shape, spec.global_shape),
        ));
    }
    let elem: u64 = match e.dtype.as_str() {
        "F32" => 4,
        "F64" => 8,
        _ => 2,
    };
    let shape = &e.shape;
    let (dim, offset, len) = match spec.split {
        Some(Split { dim, offset, len }) => (dim, offset, len),
        None => (0, 0, shape.first().copied().unwrap_or(1)),
    };
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let full = shape.get(dim).copied().unwrap_or(1);
    let mut f = File::open(path).map_err(|e| bad(path, e))?;
    let mut raw = vec![0u8; outer * len * inner * elem as usize];
    let run = len * inner * elem as usize;
    for o in 0..outer {
        let at = data_start + e.begin + ((o * full + offset) * inner) as u64 * elem;
        f.seek(SeekFrom::Start(at)).map_err(|err| bad(path, err))?;
        f.read_exact(&mut raw[o * run..(o + 1) * run])
            .map_err(|err| bad(path, format!("{name}: {err}")))?;
    }
    let mut local_shape = shape.clone();
    if !local_shape.is_empty() {
        local_shape[dim] = len;
    }
    let t = match e.dtype.as_str() {
        "F32" => Tensor::from_vec(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect::<Vec<_>>(),
            local_shape,
            &Device::Cpu,
        )?,
        "F64" => Tensor::from_vec(
            raw.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect::<Vec<_>>(),
            local_shape,
            &Device::Cpu,
        )?,
        _ => Tensor::from_vec(
            raw.chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                .collect::<Vec<_>>(),
            local_shape,
            &Device::Cpu,
        )?,
    };
    Ok((t.to_dtype(dtype)?, raw.len() as u64))
}

/// Loads every parameter's slice from `path` into the parameters; returns the bytes read.
pub fn load_params(path: &Path, params: &[&Param]) -> Result<u64> {
    let mut read = 0;
    for p in params {
        let (t, n) = load_slice(path, &p.name, &p.spec, p.tensor().dtype())?;
        p.var.set(&t)?;
        read += n;
    }
    Ok(read)
}

/// Gathers every rank's slices of `params` over `comm` (the module's ranks; the same
/// parameter names on every rank that holds them) and returns the full tensors on member 0,
/// `None` on the others.
pub fn gather_full(
    comm: &dyn Communicator,
    params: &[&Param],
) -> Result<Option<BTreeMap<String, Tensor>>> {
    let dtype = params.first().map_or(DType::F32, |p| p.tensor().dtype());
    let mut meta = Vec::new();
    let mut data: Vec<f64> = Vec::new();
    for p in params {
        let v: Vec<f64> = p.tensor().to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        meta.push(serde_json::json!({
            "name": p.name, "shape": p.spec.global_shape,
            "split": p.spec.split.map(|s| [s.dim, s.offset, s.len]), "len": v.len(),
        }));
        data.extend(v);
    }
    let meta = serde_json::to_vec(&meta).map_err(|e| NnError::Input(e.to_string()))?;
    const META: u32 = 0x5741;
    const DATA: u32 = 0x5742;
    if comm.rank() != 0 {
        comm.send(&[meta.len() as i64, data.len() as i64], 0, META)?;
        comm.send_bytes(&meta, 0, META)?;
        comm.send(&data, 0, DATA)?;
        return Ok(None);
    }
    let mut full: BTreeMap<String, (Vec<usize>, Vec<f64>)> = BTreeMap::new();
    let mut place = |meta: &[u8], data: &[f64]| -> Result<()> {
        let entries: Vec<serde_json::Value> =
            serde_json::from_slice(meta).map_err(|e| NnError::Input(e.to_string()))?;
        let mut at = 0;
        for e in entries {
            let name = e["name"].as_str().unwrap_or_default().to_string();
            let shape: Vec<usize> = e["shape"]
                .as_array()
                .map(|a| {
                    a.iter().filter_map(serde_json::Value::as_u64).map(|x| x as usize).collect()
                })
                .unwrap_or_default();
            let len = e["len"].as_u64().unwrap_or(0) as usize;
            let part = &data[at..at + len];
            at += len;
            let entry = full
                .entry(name)
                .or_insert_with(|| (shape.clone(), vec![0.0; shape.iter().product()]));
            match e["split"].as_array() {
                Some(s) if s.len() == 3 => {
                    let (dim, off, l) = (
                        s[0].as_u64().unwrap_or(0) as usize,
                        s[1].as_u64().unwrap_or(0) as usize,
                        s[2].as_u64().unwrap_or(0) as usize,
                    );
                    let outer: usize = shape[..dim].iter().product();
                    let inner: usize = shape[dim + 1..].iter().product();
                    for o in 0..outer {
                        let dst = (o * shape[dim] + off) * inner;
                        entry.1[dst..dst + l * inner]
                            .copy_from_slice(&part[o * l * inner..(o + 1) * l * inner]);
                    }
                }
                _ => entry.1.copy_from_slice(part),
            }
        }
        Ok(())
    };
    place(&meta, &data)?;
    for src in 1..comm.size() {
        let mut sizes = [0i64; 2];
        comm.recv(&mut sizes, src, META)?;
        let mut m = vec![0u8; sizes[0] as usize];
        comm.recv_bytes(&mut m, src, META)?;
        let mut d = vec![0.0f64; sizes[1] as usize];
        comm.recv(&mut d, src, DATA)?;
        place(&m, &d)?;
    }
    full.into_iter()
        .map(|(n, (shape, v))| Ok((n, Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)?)))
        .collect::<Result<_>>()
        .map(Some)
}
