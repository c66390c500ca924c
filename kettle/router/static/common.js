// What the chat page and the dashboard share: the theme, the API key, the header's model facts.

const THEME_KEY = "kettle.theme";
const API_KEY = "kettle.apiKey";

/** Applies the stored theme (if any) and makes the toggle switch between light and dark. */
export function setupTheme(button, onChange = () => {}) {
  const stored = localStorage.getItem(THEME_KEY);
  if (stored === "light" || stored === "dark") document.documentElement.dataset.theme = stored;
  button.addEventListener("click", () => {
    const next = currentTheme() === "dark" ? "light" : "dark";
    document.documentElement.dataset.theme = next;
    localStorage.setItem(THEME_KEY, next);
    onChange(next);
  });
}

export function currentTheme() {
  const chosen = document.documentElement.dataset.theme;
  if (chosen) return chosen;
  return matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
}

/** True when the server was started with --api-key (the server fills in the page's meta tag). */
export function apiKeyRequired() {
  return document.querySelector('meta[name="kettle-api-key"]')?.content === "required";
}

export function storedKey() {
  return localStorage.getItem(API_KEY) || "";
}

/** The Authorization header for the stored key; none when no key is stored. */
export function authHeaders() {
  const key = storedKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** Wires the API key field, saved to local storage as it is typed. `upFront`: shown from the start when the server
 * needs a key (the chat page); otherwise only once a request is refused (the dashboard: /metrics may be open). */
export function setupKeyField(row, input, { upFront = true } = {}) {
  input.value = storedKey();
  if (upFront && apiKeyRequired()) row.hidden = false;
  input.addEventListener("input", () => {
    const key = input.value.trim();
    if (key) localStorage.setItem(API_KEY, key);
    else localStorage.removeItem(API_KEY);
  });
  return {
    /** Shows the field and moves the focus there (after a 401). */
    ask() {
      row.hidden = false;
      row.closest("details")?.setAttribute("open", "");
      input.focus();
    },
  };
}

/** Fills the header with /info's model name, quantization and decode path; returns /info's answer. */
export async function showModelInfo() {
  const name = document.getElementById("model-name");
  try {
    const response = await fetch("/info", { headers: authHeaders() });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const info = await response.json();
    name.textContent = info.model_id;
    name.title = `${info.model_dtype} on ${info.model_device_type}, up to ${info.max_total_tokens} tokens per request`;
    badge("model-quantization", info.quantization ? `quantization: ${info.quantization}` : `dtype: ${info.model_dtype}`);
    badge("model-decode", info.decode_path ? `decode: ${info.decode_path}` : "");
    return info;
  } catch (error) {
    name.textContent = `server unreachable (${error.message})`;
    return null;
  }
}

function badge(id, text) {
  const element = document.getElementById(id);
  element.textContent = text;
  element.hidden = !text;
}
