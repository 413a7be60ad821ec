#!/usr/bin/env bash
# Synthesise the spoken-question clips in src/omnistage/data/speech/ from the LibriSpeech-PC sentence pool
# (needs espeak-ng and sox: apt-get install -y espeak-ng sox). 16-bit mono WAV at 16 kHz.
set -euo pipefail
cd "$(dirname "$0")/.."
POOL=src/omnistage/data/librispeech_pc_test_clean.tsv
DEST=src/omnistage/data/speech

text_of() {  # the pool sentences with these utt_ids, joined by spaces, quotes dropped
  local ids="$*"
  awk -F'\t' -v ids=" $ids " 'index(ids, " " $1 " ") {print $3}' "$POOL" | tr -d '"' | paste -sd' '
}

clip() {  # clip NAME UTT_ID...
  local name=$1; shift
  espeak-ng -v en-us -s 190 --stdout "$(text_of "$@")" | sox -t wav - -r 16000 -b 16 -c 1 "$DEST/$name.wav"
}

clip question_2s 4507-16021-0014
clip question_3s 3729-6852-0031
clip question_5s 4077-13754-0003
clip question_20s 4507-16021-0011 5105-28241-0013 4507-16021-0033 260-123288-0017 4077-13754-0003
