# make train: set up .venv and run the main job on its embedded defaults.
# make test:  set up .venv with everything (Horovod included; Slurm and munge as root
#             where apt-get exists) and run the whole suite.
# make bench: run every benchmark section (python -m benchmarks) into benchmarks/RESULTS.md.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: train test bench horovod notebooks clean java slurm

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -e '.[test,notebooks,spark,ray]'
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

$(VENV)/.horovod: $(VENV)/.installed scripts/install_horovod.sh
	bash scripts/install_horovod.sh $(PY)
	touch $@

horovod: $(VENV)/.horovod

train: $(VENV)/.installed
	$(VENV)/bin/tfdist train configs/default.toml

# Slurm and munge for tests/test_slurm.py: installed only as root where apt-get exists
# and they are missing. Never fails the build (the test then skips, saying why).
slurm:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    ! { command -v sbatch && test -x /usr/sbin/slurmd && test -x /usr/sbin/munged; } \
	    >/dev/null 2>&1; then \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	    slurm-wlm munge) || echo "make: could not install slurm-wlm munge;" \
	    "tests/test_slurm.py will skip"; \
	fi

# Java 17 for pyspark (tests/test_spark.py): installed only as root where apt-get exists
# and java is missing.
java:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    ! command -v java >/dev/null 2>&1; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	    openjdk-17-jre-headless; \
	fi

# Two pytest workers, one test file each at a time (module fixtures such as the Spark
# and Ray sessions stay in one process): many tests wait on timeouts and start-ups, so two
# files at once keep both cores busy. Three were no faster (54 min of CPU in 33.5 min
# against 48 in 34.7) and starved Ray's start-up and elastic re-forming past their
# timeouts. `pytest tests/...` alone runs serially.
# The unit tier runs first, alone, with TensorFlow, Keras and Horovod unimportable (a unit
# test that reaches them fails); then every other test.
test: $(VENV)/.installed $(VENV)/.horovod slurm java
	$(PY) -m pytest -m unit
	TFDIST_REQUIRE_HOROVOD=1 TFDIST_REQUIRE_SPARK_RAY=1 $(PY) -m pytest -n 2 --dist loadfile -m "not unit"

# Re-executes every notebook and stores it with its outputs (plots visible on the web).
notebooks: $(VENV)/.installed $(VENV)/.horovod
	$(PY) scripts/run_notebooks.py

bench: $(VENV)/.installed $(VENV)/.horovod
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
