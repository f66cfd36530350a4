# Shell helpers the demo recipes share (sourced by demo_dflash.sh and demo_real.sh; not run alone).
# Each needs $PY (the project's python) set by the recipe first.

T0=$(date +%s)

# step TEXT...: a stage header with the seconds since the recipe started
step() { echo; echo "== [$(( $(date +%s) - T0 )) s] $*"; }

# claim_folder DIR MARKER KNOB: make DIR the recipe's output folder; a folder that holds files but
# not the MARKER file the recipe leaves was not made by it, and is refused, naming the KNOB that
# picks another (a recipe deletes or resumes only its own folders)
claim_folder() {
    local dir=$1 marker=$2 knob=$3
    if [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ] && [ ! -e "$dir/$marker" ]; then
        echo "error: $dir exists and was not made by this demo; set $knob to a new folder" >&2
        exit 1
    fi
    mkdir -p "$dir"
    touch "$dir/$marker"
}

# vllm_installed: whether the serving engine's venv is there (make venv-vllm, or $DFLASH_PREP_VLLM_PYTHON)
vllm_installed() {
    $PY -c "from dflash_prep.engine.env import engine_python; engine_python('vllm')" 2>/dev/null
}

# vllm_has_cuda: whether the engine's own torch sees a GPU. DFlash2 needs vLLM's V2 model runner,
# which needs CUDA; the build's name cannot say it, so its torch is asked (engine_cuda)
vllm_has_cuda() {
    $PY -c "import sys; from dflash_prep.engine.env import engine_cuda; sys.exit(0 if engine_cuda('vllm') else 1)" 2>/dev/null
}
