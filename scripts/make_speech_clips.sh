#!/usr/bin/env bash
# Synthesise the spoken-question clips in src/omnistage/data/speech/ from the LibriSpeech-PC sentence pool
# (needs espeak-ng and sox: apt-get install -y espeak-ng sox), 16-bit mono at 16 kHz: the realtime bench's
# question_*.wav, and the chat bench's spoken-question set spoken/q01..q12.flac (2-15 s). `sox -R`: the same
# dither every run (the committed question_*.wav predate it: same lengths, dither differs).
set -euo pipefail
cd "$(dirname "$0")/.."
POOL=src/omnistage/data/librispeech_pc_test_clean.tsv
DEST=src/omnistage/data/speech

text_of() {  # the pool sentences with these utt_ids, joined by spaces, quotes dropped
  local ids="$*"
  awk -F'\t' -v ids=" $ids " 'index(ids, " " $1 " ") {print $3}' "$POOL" | tr -d '"' | paste -sd' '
}

clip() {  # clip FILE UTT_ID...  (FILE under $DEST; its extension picks the format)
  local file=$1; shift
  espeak-ng -v en-us -s 190 --stdout "$(text_of "$@")" | sox -R -t wav - -r 16000 -b 16 -c 1 "$DEST/$file"
}

clip question_2s.wav 4507-16021-0014
clip question_3s.wav 3729-6852-0031
clip question_5s.wav 4077-13754-0003
clip question_20s.wav 4507-16021-0011 5105-28241-0013 4507-16021-0033 260-123288-0017 4077-13754-0003

mkdir -p "$DEST/spoken"
clip spoken/q01.flac 121-121726-0011
clip spoken/q02.flac 4507-16021-0024
clip spoken/q03.flac 237-126133-0012
clip spoken/q04.flac 7729-102255-0035
clip spoken/q05.flac 7127-75947-0028
clip spoken/q06.flac 2300-131720-0030
clip spoken/q07.flac 4077-13751-0002
clip spoken/q08.flac 1580-141084-0004
clip spoken/q09.flac 1320-122617-0011
clip spoken/q10.flac 3575-170457-0050 7729-102255-0039
clip spoken/q11.flac 1188-133604-0001 1320-122617-0025
clip spoken/q12.flac 6930-81414-0004 8555-284449-0012
