# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv if it is missing and install scale-ocr with the pinned torch/torchvision (and the doctr and ray
# extras). The demo needs nothing more; `make test` (and `make install`) adds what the test suite uses: DeepSpeed's
# prebuilt ops and, as root with apt-get, the cluster engines the launcher tests start on this host and real PDFs.

VENV    ?= .venv
PY      := $(VENV)/bin/python
PACKAGE := $(VENV)/.package
STAMP   := $(VENV)/.installed
NPROC   ?= 2
FULL    ?= 0

.PHONY: install ops engines fonts real-pdfs demo test test-fast lint clean

$(PACKAGE): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev,doctr,ray]"
	@touch $(PACKAGE)

$(STAMP): $(PACKAGE)
	@$(MAKE) --no-print-directory ops engines fonts real-pdfs
	@touch $(STAMP)

install: $(STAMP)

# DeepSpeed compiles C++ ops the first time a job needs them (about a minute each on 2 cores). They are built
# here, once, into .venv/torch_extensions, where every scale_ocr launch looks (scale_ocr/distributed/extensions.py), so
# no job waits on a compiler. NVMe offload's async_io op links against libaio: its headers are installed
# through apt-get when missing and we are root; without them every other strategy works and
# --strategy zero3_nvme stops with one line saying what to install.
ops:
	@if ! $(PY) -c "from deepspeed.ops.op_builder import AsyncIOBuilder as B; raise SystemExit(not B().is_compatible())" \
			>/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev; \
		else \
			echo "note: libaio's headers are missing (apt-get install libaio-dev): --strategy zero3_nvme will not run"; \
		fi; \
	fi
	-@$(PY) -m scale_ocr.distributed.extensions 2>&1 | grep "^scale-ocr"

# The cluster engines that tests/cluster/ runs for real on this host (docs/launchers.md): a SLURM controller and node
# daemon with munge, sshd + pdsh (DeepSpeed's default multi-node launcher) and Open MPI. Installed through apt-get
# when missing and we are root; otherwise each of those tests skips with one line naming the package.
ENGINE_PKGS := slurm-wlm munge openssh-server openssh-client pdsh openmpi-bin
engines:
	@missing=""; for p in $(ENGINE_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		else \
			echo "note: not installed:$$missing (apt-get install them as root): the cluster launcher tests will skip"; \
		fi; \
	fi

# The fonts synthetic words and pages are drawn in by default (--fonts installed: scale_ocr/data/fonts.py, docs/data.md
# "Fonts"): serif, sans, monospace, TeX and URW families from Debian's font packages, about 80 MB, installed through
# apt-get when missing and we are root; otherwise the generators draw in what is installed and tests/unit/test_fonts.py
# skips its count of families with a line naming the packages.
FONT_PKGS := fonts-dejavu-core fonts-liberation fonts-freefont-ttf fonts-urw-base35 fonts-lmodern fonts-cmu \
	fonts-texgyre fonts-crosextra-carlito fonts-crosextra-caladea fonts-open-sans fonts-ebgaramond fonts-inconsolata \
	fonts-hack fonts-go fonts-courier-prime fonts-cantarell fonts-comic-neue fonts-linuxlibertine fonts-noto-mono
fonts:
	@missing=""; for p in $(FONT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				$$missing >/dev/null; \
		else \
			echo "note: fonts not installed:$$missing (apt-get install them as root): synthetic data draws fewer"; \
		fi; \
	fi

# Real born-digital PDFs, unpacked into .venv/ (nothing installed on the system) from Debian's documentation
# packages. .venv/real-pdfs: the CamlIDL manual (camlidl-doc: 26 pages of LaTeX prose and code, 190 KB), which
# tests/unit/test_make_dataset.py reads, and the FreeFEM manual (freefem-doc: 50 pages, 320 KB), which with it makes
# the real-document benchmark's set (python -m benchmarks.real_documents); both in TeX's Computer Modern.
# .venv/unseen-pdfs: documents in other font families, what benchmarks.cross_documents measures on: Backup
# Manager's user guide (backup-manager-doc: 29 pages in URW Palladio, Palatino's twin) and the FAI guide (fai-doc:
# 38 pages in Nimbus Roman, Times's, headings in Nimbus Sans). Needs apt-get (the package lists are fetched once
# when missing and we are root); otherwise that test skips and the benchmarks stop, each with a line.
REAL_PDFS := $(VENV)/real-pdfs
REAL_PDF_PKGS := camlidl-doc freefem-doc
UNSEEN_PDFS := $(VENV)/unseen-pdfs
UNSEEN_PDF_PKGS := backup-manager-doc fai-doc
# $(1): the folder, $(2): the packages whose PDFs (gzipped ones unpacked) go there
define fetch_pdfs
	@for pkg in $(2); do \
		test -e $(1)/.$$pkg && continue; \
		if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then \
			echo "note: no apt-get here: $$pkg's PDFs are not fetched (the tests and benchmarks that read them skip)"; \
			continue; \
		fi; \
		tmp=$$(mktemp -d); \
		(cd $$tmp && apt-get download -qq $$pkg 2>/dev/null) || \
			{ [ "$$(id -u)" = 0 ] && apt-get update -qq && (cd $$tmp && apt-get download -qq $$pkg 2>/dev/null); }; \
		if ls $$tmp/$${pkg}_*.deb >/dev/null 2>&1 && dpkg-deb -x $$tmp/$${pkg}_*.deb $$tmp/x; then \
			find $$tmp/x -name '*.pdf.gz' -exec gunzip {} \; ; \
			mkdir -p $(1) && find $$tmp/x -name '*.pdf' -exec cp {} $(1)/ \; && touch $(1)/.$$pkg; \
		else \
			echo "note: could not fetch $$pkg (apt-get download): its PDFs are missing from $(1)"; \
		fi; \
		rm -rf $$tmp; \
	done
endef
real-pdfs:
	$(call fetch_pdfs,$(REAL_PDFS),$(REAL_PDF_PKGS))
	$(call fetch_pdfs,$(UNSEEN_PDFS),$(UNSEEN_PDF_PKGS))

# A real 2-rank DDP training on synthetic words (CPU + gloo without GPUs) with the project's own recipe (the
# CRNN's rate at its reference global batch, 64, and OneCycle), then a one-screen summary and runs/demo/curves.png.
# Its length, 960 steps of fresh words, reads 85% of held-out words within 5 minutes of training on 2 cores (the
# CRNN's head starts at the blank's prior, scale_ocr/models/recognition/ctc.py, so it reads its first words about a
# third of the way). What it read is quoted once, in README.md.
# --eval-every 32 draws the accuracy curve; --resume none moves an earlier runs/demo aside, it never deletes it.
# --fonts classic draws its words in the four DejaVu faces, so what it reads does not depend on the fonts a host has
# (training's default draws every installed font: 49.6% of held-out words in 76 families after these 960 steps).
# OMP_NUM_THREADS is scale-ocr's own default for a CPU rank (the cores shared by the ranks), given here so that
# torchrun does not open the demo with its banner about setting it.
demo: $(PACKAGE)
	OMP_NUM_THREADS=$$(( $$(nproc) / $(NPROC) > 0 ? $$(nproc) / $(NPROC) : 1 )) \
	$(VENV)/bin/torchrun --nproc_per_node $(NPROC) scale_ocr/train.py --strategy ddp \
		--train-samples 61440 --fonts classic --epochs 1 --eval-every 32 --log-every 64 --resume none \
		--output-dir runs/demo
	@$(VENV)/bin/scale-ocr summary runs/demo

# Fast suite; FULL=1 (what CI runs) adds the multi-process and learning tests marked slow. In two parts:
# tests/unit, where each test runs one process (a few start two ranks), spread over the cores by pytest-xdist (a test
# mostly waits on Python's imports, one core at a time: two at once take 0.6 of the time on 2 cores); then
# tests/distributed and tests/cluster one at a time, as each starts ranks sized for the whole machine and some pace
# themselves on it (the SLURM warning, the launchers' timeouts). Both parts run; either failing fails the target.
TEST_WORKERS ?= auto
test: $(STAMP)
	@rc=0; \
	SCALE_OCR_FULL_TESTS=$(FULL) $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15 tests/unit || rc=$$?; \
	SCALE_OCR_FULL_TESTS=$(FULL) $(PY) -m pytest -q --durations=15 tests/distributed tests/cluster || rc=$$?; \
	exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check scale_ocr tests benchmarks

clean:
	rm -rf runs .pytest_cache .ruff_cache
