//! The vision encoder's front end: an image file to the `[3, size, size]` pixels a ViT
//! takes.
//!
//! PNG, JPEG or WebP, known by the file's bytes rather than its name (a JPEG saved as
//! `.png` reads as JPEG; grey, palette, 16-bit and alpha images become 8-bit RGB, the alpha
//! dropped; no EXIF rotation is applied, as PIL's `Image.open(...).convert("RGB")` applies
//! none), resized to `size x size` with a bicubic (Catmull-Rom) filter as
//! SigLIP's processor does (the aspect ratio is not kept: the whole image is squeezed
//! into the square), and normalized SigLIP's way, `(x / 255 - 0.5) / 0.5` per channel, so
//! values lie in [-1, 1]. Channel-major, row-major within a channel.

use std::path::Path;

use image::imageops::FilterType;

use crate::error::{DataError, Result};

/// The pixels of the image at `path`, resized to `size` and normalized: `3 * size * size`
/// values, channel by channel.
pub fn load_image(path: &Path, size: u32) -> Result<Vec<f32>> {
    let bad = |e: &dyn std::fmt::Display| DataError::Encode {
        path: path.to_path_buf(),
        message: format!("unreadable image: {e}"),
    };
    // A regular file only: a FIFO in its place would never open.
    let file = crate::files::open_regular(path).map_err(|e| bad(&e))?;
    let mut reader = image::ImageReader::new(std::io::BufReader::new(file));
    if let Ok(format) = image::ImageFormat::from_path(path) {
        reader.set_format(format);
    }
    let img = reader.with_guessed_format().map_err(|e| bad(&e))?.decode().map_err(|e| bad(&e))?;
    Ok(normalize(&img.to_rgb8(), size))
}

/// `img` resized to `size` and normalized, channel-major.
pub fn normalize(img: &image::RgbImage, size: u32) -> Vec<f32> {
    let resized = if img.dimensions() == (size, size) {
        std::borrow::Cow::Borrowed(img)
    } else {
        std::borrow::Cow::Owned(image::imageops::resize(img, size, size, FilterType::CatmullRom))
    };
    let plane = (size * size) as usize;
    let mut out = vec![0.0f32; 3 * plane];
    for (i, px) in resized.pixels().enumerate() {
        for c in 0..3 {
            out[c * plane + i] = (f32::from(px.0[c]) / 255.0 - 0.5) / 0.5;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::{load_image, normalize};

    #[test]
    fn pixels_are_channel_major_in_minus_one_to_one() {
        let img = image::RgbImage::from_fn(2, 2, |x, y| {
            image::Rgb([255, (x * 255) as u8, (y * 255) as u8])
        });
        let v = normalize(&img, 2);
        assert_eq!(v, [1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0]);
        // A flat image stays flat at any size.
        let flat = image::RgbImage::from_pixel(7, 5, image::Rgb([51, 102, 204]));
        let v = normalize(&flat, 4);
        assert_eq!(v.len(), 48);
        for (c, want) in [51.0f32, 102.0, 204.0].iter().enumerate() {
            for x in &v[c * 16..(c + 1) * 16] {
                assert!((x - (want / 255.0 - 0.5) / 0.5).abs() < 1e-6, "{x}");
            }
        }
    }

    /// JPEG and WebP read as PNG does, by their bytes: a JPEG named `.png` too.
    #[test]
    fn jpeg_and_webp_read_like_png() {
        let dir = std::env::temp_dir().join(format!("hetpar-formats-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = image::RgbImage::from_fn(16, 12, |x, y| {
            image::Rgb([(x * 15) as u8, (y * 20) as u8, 128])
        });
        let png = dir.join("a.png");
        img.save(&png).unwrap();
        let want = load_image(&png, 8).unwrap();
        // Lossless WebP: the same pixels, so the same values.
        let webp = dir.join("a.webp");
        let mut bytes = Vec::new();
        image::codecs::webp::WebPEncoder::new_lossless(&mut bytes)
            .encode(img.as_raw(), 16, 12, image::ExtendedColorType::Rgb8)
            .unwrap();
        std::fs::write(&webp, &bytes).unwrap();
        assert_eq!(load_image(&webp, 8).unwrap(), want);
        // JPEG at quality 100, under a `.png` name: within its rounding of the pixels.
        let mut bytes = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 100)
            .encode(img.as_raw(), 16, 12, image::ExtendedColorType::Rgb8)
            .unwrap();
        let named_png = dir.join("really-a-jpeg.png");
        std::fs::write(&named_png, &bytes).unwrap();
        let got = load_image(&named_png, 8).unwrap();
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 0.1, "JPEG's pixels {worst} from PNG's (in [-1, 1])");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn an_unreadable_image_names_its_file() {
        let path = std::env::temp_dir().join(format!("hetpar-bad-{}.png", std::process::id()));
        std::fs::write(&path, b"not a png").unwrap();
        let e = load_image(&path, 8).unwrap_err().to_string();
        assert!(e.contains(&format!("{}: unreadable image", path.display())), "{e}");
        std::fs::remove_file(&path).unwrap();
        let e = load_image(&path, 8).unwrap_err().to_string();
        assert!(e.contains("unreadable image"), "{e}");
    }
}
