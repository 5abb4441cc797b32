#!/usr/bin/env bash
# Installs what `make -C paper` needs on Debian: TeX Live with the ACM class
# (texlive-publishers), latexmk, librsvg2-bin (rsvg-convert: the figures' SVG to PDF)
# with the Liberation fonts the figures are laid out in, and poppler-utils (pdftoppm,
# for `make pages`).
# About 30 packages without recommends. Go is assumed installed (the repository's
# README names the version).
set -euo pipefail
pkgs=(texlive-publishers texlive-latex-extra texlive-fonts-recommended latexmk poppler-utils librsvg2-bin fonts-liberation)
missing=()
for p in "${pkgs[@]}"; do
	dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
