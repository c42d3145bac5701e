/*
 * coveil_llama: a minimal Node-API addon over the llama.cpp shared library that node-llama-cpp ships, for the
 * TypeScript SDK's LlamaCppNativeSLM (src/backends/llamaCppNative.ts), or over the one llama-cpp-python installs.  It holds one model and one context with one
 * sequence, and hands each step's logits over as a Float32Array (one copy of n_vocab floats), where node-llama-cpp
 * 3.21 hands out only a sorted JS array of probabilities built element by element.
 *
 * Built by native/build.mjs (gcc, no node-gyp) against the llama.h/ggml*.h of the library it links (node-llama-cpp's:
 * the llama.cpp commit its binaries were built from; llama-cpp-python's: the headers it installs), with an rpath to
 * the library's folder.
 *
 *   load(libDir, modelPath, contextSize, batchSize, threads, flashAttention, settings) -> handle
 *                                            settings "node-llama-cpp": the context node-llama-cpp 3.21 makes;
 *                                            "llama-cpp-python": the Python SDK's LlamaCppSLM's (llama.cpp's
 *                                            defaults but n_ctx, n_batch = n_ubatch, threads; flashAttention unused)
 *   info(handle) -> { vocabSize, bos, addBos, eog: number[], contextSize, batchSize }
 *   tokenTexts(handle) -> string[]           every token's text in id order (llama_vocab_get_text)
 *   tokenize(handle, text) -> Int32Array     no special tokens added or parsed
 *   detokenize(handle, Int32Array) -> string special tokens neither removed nor rendered
 *   clear(handle)                            empty the sequence
 *   decode(handle, Int32Array, softmaxOver) -> Promise<Float32Array>
 *                                            append ids to the sequence; the last one's logits (softmaxOver 0), or
 *                                            the softmax of its first softmaxOver logits (the rest left as logits)
 *   free(handle)
 */

#define NAPI_VERSION 8
#include <node_api.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"

typedef struct {
  struct llama_model *model;
  struct llama_context *ctx;
  const struct llama_vocab *vocab;
  int32_t n_vocab;
  uint32_t n_batch;  /* tokens per llama_decode call */
  int32_t n_past;    /* the sequence's length */
  int busy;          /* a decode is in flight */
  /* the decode in flight */
  llama_token *ids;
  int32_t n_ids;
  int32_t softmax_over; /* > 0: hand out the softmax of the first softmax_over logits */
  float *row;          /* the backing store of the ArrayBuffer row_ref holds, filled on the worker thread */
  napi_ref row_ref;
  int status;
  napi_deferred deferred;
  napi_async_work work;
} Session;

#define CHECK(env, call)                                          \
  do {                                                            \
    if ((call) != napi_ok) {                                      \
      napi_throw_error((env), NULL, "coveil_llama: " #call);     \
      return NULL;                                                \
    }                                                             \
  } while (0)

static void quiet_log(enum ggml_log_level level, const char *text, void *user_data) {
  (void)level; (void)text; (void)user_data;
}

static void session_free(Session *s) {
  if (s->ctx) llama_free(s->ctx);
  if (s->model) llama_model_free(s->model);
  s->ctx = NULL;
  s->model = NULL;
}

static void finalize(napi_env env, void *data, void *hint) {
  (void)env; (void)hint;
  Session *s = data;
  if (!s->busy) { session_free(s); free(s); }
}

static napi_value throw_error(napi_env env, const char *message) {
  napi_throw_error(env, NULL, message);
  return NULL;
}

/* args[0] as an open session, or NULL with an exception pending */
static Session *session_arg(napi_env env, napi_value value) {
  Session *s = NULL;
  if (napi_get_value_external(env, value, (void **)&s) != napi_ok || s == NULL) {
    napi_throw_type_error(env, NULL, "coveil_llama: not a session handle");
    return NULL;
  }
  if (s->ctx == NULL) { napi_throw_error(env, NULL, "coveil_llama: the session is closed"); return NULL; }
  return s;
}

/* a method's arguments (up to `room`, the rest undefined) and its first one as an open session, or NULL with an
 * exception pending */
static Session *session_call(napi_env env, napi_callback_info info, napi_value *args, size_t room) {
  size_t argc = room;
  if (napi_get_cb_info(env, info, &argc, args, NULL, NULL) != napi_ok) {
    napi_throw_error(env, NULL, "coveil_llama: napi_get_cb_info");
    return NULL;
  }
  return session_arg(env, args[0]);
}

static char *string_arg(napi_env env, napi_value value, size_t *length) {
  size_t n = 0;
  if (napi_get_value_string_utf8(env, value, NULL, 0, &n) != napi_ok) {
    napi_throw_type_error(env, NULL, "coveil_llama: expected a string");
    return NULL;
  }
  char *text = malloc(n + 1);
  napi_get_value_string_utf8(env, value, text, n + 1, &n);
  if (length) *length = n;
  return text;
}

static int32_t int_arg(napi_env env, napi_value value) {
  int32_t n = 0;
  napi_get_value_int32(env, value, &n);
  return n;
}

static napi_value load(napi_env env, napi_callback_info info) {
  size_t argc = 7;
  napi_value args[7];
  CHECK(env, napi_get_cb_info(env, info, &argc, args, NULL, NULL));
  if (argc < 7) return throw_error(env, "coveil_llama.load(libDir, modelPath, contextSize, batchSize, threads, flashAttention, settings)");
  char *settings = string_arg(env, args[6], NULL);
  if (!settings) return NULL;
  int as_python = strcmp(settings, "llama-cpp-python") == 0;
  int as_node = strcmp(settings, "node-llama-cpp") == 0;
  free(settings);
  if (!as_python && !as_node) return throw_error(env, "coveil_llama: settings must be \"node-llama-cpp\" or \"llama-cpp-python\"");
  char *lib_dir = string_arg(env, args[0], NULL);
  if (!lib_dir) return NULL;
  char *model_path = string_arg(env, args[1], NULL);
  if (!model_path) { free(lib_dir); return NULL; }
  bool flash = false;
  napi_get_value_bool(env, args[5], &flash);

  llama_log_set(quiet_log, NULL);
  /* node-llama-cpp's addon may have loaded the CPU backend into this process already (the same library) */
  if (ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) == NULL) ggml_backend_load_all_from_path(lib_dir);
  free(lib_dir);
  if (ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) == NULL) {
    free(model_path);
    return throw_error(env, "coveil_llama: no CPU backend loaded from the library's folder");
  }
  llama_backend_init();

  struct llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  if (as_node) mp.lazy_mode = LLAMA_LAZY_MODE_OFF; /* as node-llama-cpp */
  Session *s = calloc(1, sizeof(Session));
  s->model = llama_model_load_from_file(model_path, mp);
  free(model_path);
  if (!s->model) { free(s); return throw_error(env, "coveil_llama: llama.cpp could not load the model file"); }
  s->vocab = llama_model_get_vocab(s->model);
  s->n_vocab = llama_vocab_n_tokens(s->vocab);

  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = (uint32_t)int_arg(env, args[2]);
  cp.n_batch = (uint32_t)int_arg(env, args[3]);
  cp.n_ubatch = cp.n_batch;
  cp.n_threads = cp.n_threads_batch = int_arg(env, args[4]);
  if (as_node) {
    /* node-llama-cpp's context: one more token for a sliding-window cache, no perf counters */
    cp.n_batch += llama_model_n_swa(s->model) > 0 ? 1 : 0;
    cp.n_ubatch = cp.n_batch;
    cp.n_seq_max = 1;
    cp.no_perf = true;
    cp.swa_full = false;
    cp.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  }
  s->ctx = llama_init_from_model(s->model, cp);
  if (!s->ctx) {
    llama_model_free(s->model);
    free(s);
    return throw_error(env, "coveil_llama: llama.cpp could not make a context");
  }
  s->n_batch = (uint32_t)int_arg(env, args[3]);

  napi_value handle;
  CHECK(env, napi_create_external(env, s, finalize, NULL, &handle));
  return handle;
}

static napi_value set_number(napi_env env, napi_value object, const char *key, double value) {
  napi_value v;
  napi_create_double(env, value, &v);
  napi_set_named_property(env, object, key, v);
  return object;
}

static napi_value model_info(napi_env env, napi_callback_info info) {
  napi_value args[1];
  Session *s = session_call(env, info, args, 1);
  if (!s) return NULL;
  napi_value out, eog, add_bos;
  CHECK(env, napi_create_object(env, &out));
  set_number(env, out, "vocabSize", s->n_vocab);
  set_number(env, out, "bos", llama_vocab_bos(s->vocab));
  set_number(env, out, "contextSize", llama_n_ctx(s->ctx));
  set_number(env, out, "batchSize", s->n_batch);
  napi_get_boolean(env, llama_vocab_get_add_bos(s->vocab), &add_bos);
  napi_set_named_property(env, out, "addBos", add_bos);
  CHECK(env, napi_create_array(env, &eog));
  uint32_t n = 0;
  for (int32_t id = 0; id < s->n_vocab; id++) {
    if (!llama_vocab_is_eog(s->vocab, id)) continue;
    napi_value v;
    napi_create_int32(env, id, &v);
    napi_set_element(env, eog, n++, v);
  }
  napi_set_named_property(env, out, "eog", eog);
  return out;
}

static napi_value token_texts(napi_env env, napi_callback_info info) {
  napi_value args[1];
  Session *s = session_call(env, info, args, 1);
  if (!s) return NULL;
  napi_value out;
  CHECK(env, napi_create_array_with_length(env, (size_t)s->n_vocab, &out));
  for (int32_t id = 0; id < s->n_vocab; id++) {
    napi_value v;
    const char *text = llama_vocab_get_text(s->vocab, id);
    CHECK(env, napi_create_string_utf8(env, text ? text : "", NAPI_AUTO_LENGTH, &v));
    CHECK(env, napi_set_element(env, out, (uint32_t)id, v));
  }
  return out;
}

static napi_value tokenize(napi_env env, napi_callback_info info) {
  napi_value args[2];
  Session *s = session_call(env, info, args, 2);
  if (!s) return NULL;
  size_t length = 0;
  char *text = string_arg(env, args[1], &length);
  if (!text) return NULL;
  int32_t room = (int32_t)length + 2;
  llama_token *ids = malloc(sizeof(llama_token) * (size_t)room);
  int32_t n = llama_tokenize(s->vocab, text, (int32_t)length, ids, room, false, false);
  if (n < 0) { /* -n is the count needed */
    room = -n;
    ids = realloc(ids, sizeof(llama_token) * (size_t)room);
    n = llama_tokenize(s->vocab, text, (int32_t)length, ids, room, false, false);
  }
  free(text);
  if (n < 0) { free(ids); return throw_error(env, "coveil_llama: llama_tokenize failed"); }
  napi_value buffer, out;
  void *data;
  CHECK(env, napi_create_arraybuffer(env, sizeof(int32_t) * (size_t)n, &data, &buffer));
  memcpy(data, ids, sizeof(int32_t) * (size_t)n);
  free(ids);
  CHECK(env, napi_create_typedarray(env, napi_int32_array, (size_t)n, buffer, 0, &out));
  return out;
}

/* args[i] as an Int32Array's elements (borrowed), or NULL with an exception pending */
static const int32_t *ids_arg(napi_env env, napi_value value, size_t *count) {
  napi_typedarray_type type;
  void *data = NULL;
  bool is_typed = false;
  napi_is_typedarray(env, value, &is_typed);
  if (!is_typed || napi_get_typedarray_info(env, value, &type, count, &data, NULL, NULL) != napi_ok || type != napi_int32_array) {
    napi_throw_type_error(env, NULL, "coveil_llama: expected an Int32Array of token ids");
    return NULL;
  }
  return data;
}

static napi_value detokenize(napi_env env, napi_callback_info info) {
  napi_value args[2];
  Session *s = session_call(env, info, args, 2);
  if (!s) return NULL;
  size_t count = 0;
  const int32_t *ids = ids_arg(env, args[1], &count);
  if (!ids) return NULL;
  int32_t room = (int32_t)count * 8 + 16;
  char *text = malloc((size_t)room);
  int32_t n = llama_detokenize(s->vocab, ids, (int32_t)count, text, room, false, false);
  if (n < 0) {
    room = -n;
    text = realloc(text, (size_t)room);
    n = llama_detokenize(s->vocab, ids, (int32_t)count, text, room, false, false);
  }
  if (n < 0) { free(text); return throw_error(env, "coveil_llama: llama_detokenize failed"); }
  napi_value out;
  napi_status status = napi_create_string_utf8(env, text, (size_t)n, &out);
  free(text);
  CHECK(env, status);
  return out;
}

static napi_value clear(napi_env env, napi_callback_info info) {
  napi_value args[1];
  Session *s = session_call(env, info, args, 1);
  if (!s) return NULL;
  if (s->busy) return throw_error(env, "coveil_llama: a decode is in flight");
  llama_memory_clear(llama_get_memory(s->ctx), true);
  s->n_past = 0;
  return NULL;
}

/* numpy's float32 sum (pairwise, eight accumulators over blocks of at most 128), as the SDK's sumFloat32 */
static float pairwise_sum(const float *v, int32_t n) {
  if (n < 8) {
    float sum = 0.0f;
    for (int32_t i = 0; i < n; i++) sum += v[i];
    return sum;
  }
  if (n <= 128) {
    float r[8];
    for (int j = 0; j < 8; j++) r[j] = v[j];
    int32_t i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (int j = 0; j < 8; j++) r[j] += v[i + j];
    }
    float sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) sum += v[i];
    return sum;
  }
  int32_t half = n / 2;
  half -= half % 8;
  return pairwise_sum(v, half) + pairwise_sum(v + half, n - half);
}

/* row <- softmax(row) in place as the SDK's softmax at temperature 1 (src/core/fusion.ts): p(i) = exp(z(i) - max z)
 * / sum_j exp(z(j) - max z), each exponential through double rounded once to float, the sum numpy's float32 one */
static void softmax_in_place(float *row, int32_t n) {
  float top = -INFINITY;
  for (int32_t i = 0; i < n; i++) if (row[i] > top) top = row[i];
  for (int32_t i = 0; i < n; i++) row[i] = (float)exp((double)(row[i] - top));
  float total = pairwise_sum(row, n);
  for (int32_t i = 0; i < n; i++) row[i] = row[i] / total;
}

/* on a worker thread: feed s->ids in batches of n_batch, logits for the last one only; copy them into s->row */
static void decode_execute(napi_env env, void *data) {
  (void)env;
  Session *s = data;
  struct llama_batch batch = llama_batch_init((int32_t)s->n_batch, 0, 1);
  s->status = 0;
  for (int32_t start = 0; start < s->n_ids && s->status == 0; start += (int32_t)s->n_batch) {
    int32_t n = s->n_ids - start < (int32_t)s->n_batch ? s->n_ids - start : (int32_t)s->n_batch;
    batch.n_tokens = n;
    for (int32_t i = 0; i < n; i++) {
      batch.token[i] = s->ids[start + i];
      batch.pos[i] = s->n_past + i;
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = 0;
      batch.logits[i] = start + i == s->n_ids - 1;
    }
    s->status = llama_decode(s->ctx, batch);
    if (s->status == 0) s->n_past += n;
  }
  llama_batch_free(batch);
  if (s->status == 0) {
    const float *logits = llama_get_logits_ith(s->ctx, -1);
    if (logits) {
      memcpy(s->row, logits, sizeof(float) * (size_t)s->n_vocab);
      if (s->softmax_over > 0) softmax_in_place(s->row, s->softmax_over);
    } else {
      s->status = -100;
    }
  }
}

static void decode_complete(napi_env env, napi_status status, void *data) {
  Session *s = data;
  napi_value buffer, out, message, error;
  free(s->ids);
  s->ids = NULL;
  s->busy = 0;
  napi_delete_async_work(env, s->work);
  napi_get_reference_value(env, s->row_ref, &buffer);
  napi_delete_reference(env, s->row_ref);
  s->row_ref = NULL;
  s->row = NULL;
  if (status == napi_ok && s->status == 0) {
    napi_create_typedarray(env, napi_float32_array, (size_t)s->n_vocab, buffer, 0, &out);
    napi_resolve_deferred(env, s->deferred, out);
  } else {
    char text[96];
    snprintf(text, sizeof text, "coveil_llama: llama_decode failed (status %d)", s->status);
    napi_create_string_utf8(env, text, NAPI_AUTO_LENGTH, &message);
    napi_create_error(env, NULL, message, &error);
    napi_reject_deferred(env, s->deferred, error);
  }
}

static napi_value decode(napi_env env, napi_callback_info info) {
  napi_value args[3];
  Session *s = session_call(env, info, args, 3);
  if (!s) return NULL;
  if (s->busy) return throw_error(env, "coveil_llama: a decode is in flight");
  size_t count = 0;
  const int32_t *ids = ids_arg(env, args[1], &count);
  if (!ids) return NULL;
  if (count == 0) return throw_error(env, "coveil_llama: decode needs at least one token");
  if ((size_t)s->n_past + count > llama_n_ctx(s->ctx)) return throw_error(env, "coveil_llama: the context window is full");
  for (size_t i = 0; i < count; i++) {
    if (ids[i] < 0 || ids[i] >= s->n_vocab) return throw_error(env, "coveil_llama: a token id is out of the vocabulary");
  }
  int32_t softmax_over = int_arg(env, args[2]);
  if (softmax_over < 0 || softmax_over > s->n_vocab) return throw_error(env, "coveil_llama: softmaxOver is outside [0, n_vocab]");
  s->softmax_over = softmax_over;
  s->ids = malloc(sizeof(llama_token) * count);
  memcpy(s->ids, ids, sizeof(llama_token) * count);
  s->n_ids = (int32_t)count;
  /* the row is a JS-owned ArrayBuffer made here and held by a reference while the worker writes into it (an external
   * buffer over addon memory is refused where V8's sandbox is on, as in Electron) */
  napi_value promise, name, buffer;
  CHECK(env, napi_create_arraybuffer(env, sizeof(float) * (size_t)s->n_vocab, (void **)&s->row, &buffer));
  CHECK(env, napi_create_reference(env, buffer, 1, &s->row_ref));
  CHECK(env, napi_create_promise(env, &s->deferred, &promise));
  CHECK(env, napi_create_string_utf8(env, "coveil_llama.decode", NAPI_AUTO_LENGTH, &name));
  CHECK(env, napi_create_async_work(env, NULL, name, decode_execute, decode_complete, s, &s->work));
  CHECK(env, napi_queue_async_work(env, s->work));
  s->busy = 1;
  return promise;
}

static napi_value free_session(napi_env env, napi_callback_info info) {
  size_t argc = 1;
  napi_value args[1];
  CHECK(env, napi_get_cb_info(env, info, &argc, args, NULL, NULL));
  Session *s = NULL;
  if (napi_get_value_external(env, args[0], (void **)&s) != napi_ok || s == NULL) return throw_error(env, "coveil_llama: not a session handle");
  if (s->busy) return throw_error(env, "coveil_llama: a decode is in flight");
  session_free(s);
  return NULL;
}

static napi_value init(napi_env env, napi_value exports) {
  napi_property_descriptor methods[] = {
    {"load", NULL, load, NULL, NULL, NULL, napi_default, NULL},
    {"info", NULL, model_info, NULL, NULL, NULL, napi_default, NULL},
    {"tokenTexts", NULL, token_texts, NULL, NULL, NULL, napi_default, NULL},
    {"tokenize", NULL, tokenize, NULL, NULL, NULL, napi_default, NULL},
    {"detokenize", NULL, detokenize, NULL, NULL, NULL, napi_default, NULL},
    {"clear", NULL, clear, NULL, NULL, NULL, napi_default, NULL},
    {"decode", NULL, decode, NULL, NULL, NULL, napi_default, NULL},
    {"free", NULL, free_session, NULL, NULL, NULL, napi_default, NULL},
  };
  if (napi_define_properties(env, exports, sizeof methods / sizeof methods[0], methods) != napi_ok) return NULL;
  return exports;
}

NAPI_MODULE_INIT() {
  return init(env, exports);
}
