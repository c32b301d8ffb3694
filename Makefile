# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench bench-peers clean

setup: $(STAMP)

# Re-installs only when pyproject.toml changes; a second run does nothing.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@# the web page's test drives Debian's headless Chromium; where apt-get cannot install it, that test is skipped
	command -v chromedriver >/dev/null || ! command -v apt-get >/dev/null || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null || \
		echo "chromium could not be installed: the web page's browser test will be skipped"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) examples/image_qa.py

bench: $(STAMP)
	$(PY) -m mmkv.bench cache --json

# The peers that take long to install, for `python -m mmkv.bench prefix --peers llama.cpp`:
# llama-cpp-python compiles llama.cpp (about 11 minutes on 2 cores) with only the instruction sets
# this CPU lists, never AMX (llama_cpp_peer.cmake_args), rebuilt even when installed;
# its source distribution also carries llama.cpp's GGUF converter, which goes to .peers/llama.cpp.
LLAMA_CPP := 0.3.36
PEERS := .peers/llama.cpp/convert_hf_to_gguf.py

bench-peers: $(PEERS)

$(PEERS): $(STAMP)
	CMAKE_ARGS="$$($(PY) -c 'from mmkv.bench.llama_cpp_peer import cmake_args; print(cmake_args())')" && \
		echo "llama.cpp: $$CMAKE_ARGS" && export CMAKE_ARGS && \
		$(PY) -m pip install --quiet --force-reinstall --no-deps --no-cache-dir 'llama-cpp-python==$(LLAMA_CPP)'
	$(PY) -m pip install --quiet 'llama-cpp-python==$(LLAMA_CPP)' 'gguf==0.19.0' 'sentencepiece==0.2.3' 'xgrammar==0.2.9'
	rm -rf .peers/src && mkdir -p .peers/src
	$(PY) -m pip download --quiet --no-deps --no-binary :all: 'llama-cpp-python==$(LLAMA_CPP)' -d .peers/src
	tar -xzf .peers/src/llama_cpp_python-$(LLAMA_CPP).tar.gz -C .peers/src \
		llama_cpp_python-$(LLAMA_CPP)/vendor/llama.cpp/convert_hf_to_gguf.py \
		llama_cpp_python-$(LLAMA_CPP)/vendor/llama.cpp/conversion \
		llama_cpp_python-$(LLAMA_CPP)/vendor/llama.cpp/gguf-py
	rm -rf .peers/llama.cpp && mv .peers/src/llama_cpp_python-$(LLAMA_CPP)/vendor/llama.cpp .peers/llama.cpp
	rm -rf .peers/src

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .peers
