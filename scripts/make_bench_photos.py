"""Write the visual-question photos in src/omnistage/data/photos/ from scikit-image's sample data (BSD-3
package; these photos are public domain or CC0, see data/README.md): JPEG, quality 90, at their own sizes.
Needs scikit-image (`pip install scikit-image`), only here: the bench reads the JPEGs.
usage: python scripts/make_bench_photos.py"""

from pathlib import Path

import skimage.data
from PIL import Image

DEST = Path(__file__).parents[1] / "src" / "omnistage" / "data" / "photos"
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")

if __name__ == "__main__":
    DEST.mkdir(parents=True, exist_ok=True)
    for name in PHOTOS:
        Image.fromarray(getattr(skimage.data, name)()).save(DEST / f"{name}.jpg", quality=90)
        print(DEST / f"{name}.jpg", (DEST / f"{name}.jpg").stat().st_size)
