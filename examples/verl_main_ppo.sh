#!/usr/bin/env bash
# verl's own trainer (`python -m verl.trainer.main_ppo`, Ray, a rollout server, weight sync) with tokendyn's
# Reweight, Lopti and probe, on a laptop CPU: two GRPO steps of the embedded default policy on K&K.
#   bash examples/verl_main_ppo.sh [OUT_DIR [OVERRIDE ...]]    (default runs/verl_main_ppo)
# Environment: TOKENDYN=0 leaves tokendyn's lines out (plain verl), STEPS (2), RANKS (1 actor rank), MODEL, PYTHON.
# What makes it run without a GPU (docs/verl.md, "verl's own trainer on a CPU"):
#   VERL_PLATFORM=cpu                       tokendyn's CPU platform for verl (registered by the plugin)
#   actor_rollout_ref.rollout.name=hf       tokendyn's Hugging Face `generate` rollout server
#   +ray_kwargs.ray_init.num_gpus=RANKS     one logical GPU per actor rank (torch stays on the CPU)
#   ray_kwargs.ray_init.num_cpus=3 RANKS + 3, transfer_queue...num_data_storage_units=1: room for verl's Ray actors
#   actor_rollout_ref.rollout.dtype=float32 the hf server samples in float32, as the actor trains (verl's default
#                                           bfloat16 samples as a bf16 vLLM would: a sampler / trainer mismatch)
# (and strategy=fsdp2, sdpa attention, no torch compile; docs/verl.md has the table and the GPU form: drop these,
# pick verl's rollout, vllm or sglang, and the mixed precision to train with). The K&K rows hold the whole prompt,
# chat template included, hence custom_chat_template passing it through as written.
set -euo pipefail

main() {
  OUT=${1:-runs/verl_main_ppo}
  PY=${PYTHON:-python}
  MODEL=${MODEL:-$($PY -c 'from tokendyn.policy import default_policy_dir; print(default_policy_dir())')}
  REWARD=$($PY -c 'import tokendyn.integrations.verl.kk_reward as m; print(m.__file__)')
  STEPS=${STEPS:-2}
  RANKS=${RANKS:-1}  # actor ranks (FSDP2 over gloo): one logical GPU each
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
  [ -f "$OUT/train.parquet" ] || $PY -m tokendyn kk generate --people 3 --count 8 --split train --out "$OUT/train.parquet"
  [ -f "$OUT/val.parquet" ] || $PY -m tokendyn kk generate --people 3 --start 8 --count 2 --out "$OUT/val.parquet"

  TOKENDYN_OVERRIDES=(
    actor_rollout_ref.actor.policy_loss._target_=tokendyn.integrations.verl.TokendynPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=tokendyn
    +actor_rollout_ref.actor.policy_loss.base_loss_mode=vanilla
    +actor_rollout_ref.actor.policy_loss.reweight_alpha=0.3
    +actor_rollout_ref.actor.policy_loss.lopti_eta=0.5
    "+actor_rollout_ref.actor.policy_loss.probe_dir=$OUT/probe"
    +actor_rollout_ref.actor.policy_loss.probe_options.bins=intervals:4
    +actor_rollout_ref.actor.policy_loss.probe_analyses_every=10
  )
  [ "${TOKENDYN:-1}" = 1 ] || TOKENDYN_OVERRIDES=()

  VERL_PLATFORM=cpu OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0 \
  $PY -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$OUT/train.parquet" data.val_files="$OUT/val.parquet" \
    data.train_batch_size=2 data.max_prompt_length=160 data.max_response_length=104 \
    data.dataloader_num_workers=0 \
    actor_rollout_ref.model.path="$MODEL" \
    "actor_rollout_ref.model.custom_chat_template='{{ messages[0].content }}'" \
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
    actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=2 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.use_torch_compile=False \
    actor_rollout_ref.actor.fsdp_config.use_torch_compile=False \
    actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.tensor_model_parallel_size="$RANKS" \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.dtype=float32 \
    actor_rollout_ref.rollout.agent.num_workers=1 reward.num_workers=1 \
    reward.custom_reward_function.path="$REWARD" \
    trainer.n_gpus_per_node="$RANKS" trainer.nnodes=1 trainer.total_training_steps="$STEPS" \
    trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 \
    trainer.logger='["console"]' trainer.project_name=tokendyn trainer.experiment_name=verl_main_ppo \
    trainer.default_local_dir="$OUT/checkpoints" \
    ray_kwargs.ray_init.num_cpus=$((3 * RANKS + 3)) +ray_kwargs.ray_init.num_gpus="$RANKS" \
    transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
    hydra.run.dir="$OUT/hydra" \
    "${TOKENDYN_OVERRIDES[@]}" \
    "${@:2}"
}

main "$@"  # read whole before it runs: editing the file meanwhile cannot change a running command
